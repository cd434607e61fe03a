"""The socket-free part of the ZeroMQ request API (docs/PROTOCOL.md §8): client frames parsed
into commands or the `ApiError` to answer, `ClientTable`, the outstanding requests per client, and
`EmbeddingGather`, the vectors of one `embed` request as its inputs finish.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import attrs
import numpy as np
import numpy.typing as npt

from skippy_zmq.driver.engine import Delta, Done, Event, Failed
from skippy_zmq.driver.generation import GenerationResult
from skippy_zmq.errors import RequestJsonError, TokenizerError
from skippy_zmq.gateway.embedding_api import EmbeddingParams
from skippy_zmq.gateway.metrics import GatewayMetrics
from skippy_zmq.gateway.openai_api import ApiError, CompletionParams, Endpoint, ToolAnswers, Usage, finish_reason
from skippy_zmq.gateway.reasoning import ReasoningReader
from skippy_zmq.gateway.request_json import RequestJson, is_text, shown
from skippy_zmq.gateway.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from skippy_zmq.gateway.state import (
    ClientLimiter,
    ClientSlot,
    EngineLike,
    GatewayState,
)
from skippy_zmq.tokens.logprobs import TokenLogprobs
from skippy_zmq.tokens.tokenizer import Tokenizer
from skippy_zmq.wire.request_api import (
    MAX_FRAME_BYTES,
    MAX_ID_CHARS,
    MAX_WAITING_IDS,
    PROTOCOL_VERSION,
    RESERVED_FIELDS,
)

SUPPORTED_VERSIONS = (PROTOCOL_VERSION,)
"""Protocol versions this gateway speaks (reported by `info`)."""
CLIENT_SILENCE_S = 15.0
"""A client with outstanding requests not heard from for longer has them cancelled (3 pings)."""
JsonObject: TypeAlias = dict[str, Any]
_ENDPOINTS = {"completion": Endpoint.COMPLETIONS, "chat": Endpoint.CHAT}
_MAX_TOKEN_ID = 2**31 - 1  # token ids are int32 on the stage link (docs/PROTOCOL.md §2.2)
_TEXT_FIELDS = {"tokenize": ("content", "add_special"), "detokenize": ("tokens",)}
_DEFAULT_KINDS = {400: "invalid_request", 404: "not_found", 409: "duplicate_id", 413: "too_large"}


@attrs.frozen
class Submit:
    """A completion or chat request, its fields already validated."""

    request_id: str
    params: CompletionParams


@attrs.frozen
class Cancel:
    """Give up on an outstanding request."""

    request_id: str


@attrs.frozen
class Ping:
    """A heartbeat; answered with a pong, and with a 404 error frame for each id in `waiting`
    that is not one of the client's outstanding requests."""

    request_id: str | None = None
    waiting: tuple[str, ...] = ()


@attrs.frozen
class Info:
    """Ask what the gateway serves."""

    request_id: str | None = None


@attrs.frozen
class Tokenize:
    """Text to token ids with the served model's tokenizer; `add_special`: with the BOS a prompt starts with."""

    request_id: str
    content: str
    add_special: bool = False


@attrs.frozen
class Detokenize:
    """Token ids to text with the served model's tokenizer."""

    request_id: str
    tokens: tuple[int, ...]


@attrs.frozen
class Embed:
    """An embeddings request, its fields already validated (the `/v1/embeddings` body's)."""

    request_id: str
    params: EmbeddingParams


Command: TypeAlias = Submit | Embed | Cancel | Ping | Info | Tokenize | Detokenize
TextCommand: TypeAlias = Tokenize | Detokenize


def decode_message(frames: Sequence[bytes]) -> JsonObject:
    """The JSON object of a client message (the frames after the routing id); ApiError otherwise."""
    check_frame_count(len(frames))
    return decode_frame(frames[0])


def check_frame_count(count: int) -> None:
    """ApiError 400 unless a message has exactly one frame after the routing id."""
    if count != 1:
        raise ApiError.invalid(None, f"a request is one frame holding a JSON object; got {count} frames")


def decode_frame(data: bytes) -> JsonObject:
    """The JSON object of a message's one frame; ApiError 413 above the frame limit, 400 otherwise
    (for text that is not valid Unicode, naming the field)."""
    return _checked(_parse_frame(data))


def _parse_frame(data: bytes) -> RequestJson:
    """The frame's JSON object, its text not yet checked (so that a valid id can still be echoed)."""
    if len(data) > MAX_FRAME_BYTES:
        raise ApiError(413, f"request frame of {len(data)} bytes exceeds the limit of {MAX_FRAME_BYTES} bytes",
                       code="too_large")
    try:
        document = RequestJson.parse(data, "request frame")
    except RequestJsonError as exc:
        raise ApiError.from_exception(exc) from None
    if not isinstance(document.value, dict):
        raise ApiError.invalid(None, f"the request frame must hold a JSON object, not {type(document.value).__name__}")
    return document


def _checked(document: RequestJson) -> JsonObject:
    try:
        obj: JsonObject = document.checked()
    except RequestJsonError as exc:
        raise ApiError.from_exception(exc) from None
    return obj


def readable_id(obj: Mapping[str, Any]) -> str | None:
    """The message's request id when it is a valid one (error frames echo it), else None."""
    request_id = obj.get("id")
    ok = isinstance(request_id, str) and 1 <= len(request_id) <= MAX_ID_CHARS and is_text(request_id)
    return request_id if ok else None


def parse_command(obj: Mapping[str, Any], defaults: SamplingDefaults = NO_DEFAULTS) -> Command:
    """The command of a decoded message (`defaults`: the server's sampling defaults); ApiError (400) naming
    the bad field otherwise."""
    version = obj.get("v")
    if not (type(version) is int and version in SUPPORTED_VERSIONS):
        raise ApiError.invalid("v", f"unsupported protocol version {version!r}; this gateway speaks "
                               + ", ".join(map(str, SUPPORTED_VERSIONS)))
    kind = obj.get("type")
    if "id" in obj and readable_id(obj) is None:
        raise ApiError.invalid("id", f"id must be a string of 1 to {MAX_ID_CHARS} characters, got {obj['id']!r:.80}")
    request_id = readable_id(obj)
    endpoint = _ENDPOINTS.get(kind) if isinstance(kind, str) else None
    if endpoint is not None:
        if request_id is None:
            raise ApiError.invalid("id", f"a {kind} request needs an id")
        body = {name: value for name, value in obj.items() if name not in RESERVED_FIELDS}
        if body.get("stream") is None:
            body["stream"] = True  # the request API streams unless asked not to
        return Submit(request_id, CompletionParams.from_body(endpoint, body, defaults))
    if kind == "embed":
        if request_id is None:
            raise ApiError.invalid("id", "an embed request needs an id")
        return Embed(request_id, EmbeddingParams.from_body({k: v for k, v in obj.items() if k not in RESERVED_FIELDS}))
    if isinstance(kind, str) and kind in _TEXT_FIELDS:
        return _text_command(kind, request_id, obj)
    if kind not in ("cancel", "ping", "info"):
        raise ApiError.invalid("type", f"unknown type {kind!r}; expected completion, chat, embed, tokenize, "
                               "detokenize, cancel, ping or info")
    allowed = RESERVED_FIELDS | ({"waiting"} if kind == "ping" else set())
    extra = sorted(set(obj) - allowed)
    if extra:
        fields = "v, type, id and waiting" if kind == "ping" else "v, type and id"
        article = "an" if kind == "info" else "a"
        raise ApiError.invalid(shown(extra[0]), f"unknown field {extra[0]!r:.80}: {article} {kind} message has only "
                               f"{fields}")
    if kind == "cancel":
        if request_id is None:
            raise ApiError.invalid("id", "a cancel needs the id of the request to cancel")
        return Cancel(request_id)
    if kind == "ping":
        return Ping(request_id, _waiting_ids(obj.get("waiting", [])))
    return Info(request_id)


def _text_command(kind: str, request_id: str | None, obj: Mapping[str, Any]) -> TextCommand:
    """A tokenize or detokenize message; ApiError (400) naming the missing, bad or unknown field."""
    fields = _TEXT_FIELDS[kind]
    extra = sorted(set(obj) - RESERVED_FIELDS - set(fields))
    if extra:
        raise ApiError.invalid(shown(extra[0]), f"unknown field {extra[0]!r:.80}: a {kind} message has only v, "
                               f"type, id and {' and '.join(fields)}")
    if request_id is None:
        raise ApiError.invalid("id", f"a {kind} request needs an id")
    if kind == "tokenize":
        content, add_special = obj.get("content"), obj.get("add_special")
        if not isinstance(content, str):
            raise ApiError.invalid("content", f"content must be the string to tokenize, got {content!r:.80}")
        if add_special is not None and not isinstance(add_special, bool):
            raise ApiError.invalid("add_special", f"add_special must be true or false, got {add_special!r:.80}")
        return Tokenize(request_id, content, bool(add_special))
    return Detokenize(request_id, _token_ids(obj.get("tokens")))


def _token_ids(value: Any) -> tuple[int, ...]:
    """A detokenize message's `tokens`: a list of token ids; ApiError (400) otherwise."""
    if not isinstance(value, list):
        raise ApiError.invalid("tokens", f"tokens must be a list of token ids, got {value!r:.80}")
    bad = [item for item in value if type(item) is not int or not 0 <= item <= _MAX_TOKEN_ID]
    if bad:  # an OversizedInteger shows as "an integer of N digits"
        raise ApiError.invalid("tokens", f"tokens holds {bad[0]!r:.80}; token ids are integers in "
                               f"[0, {_MAX_TOKEN_ID}]")
    return tuple(value)


def text_answer(tokenizer: Tokenizer, command: TextCommand) -> JsonObject:
    """The `tokens` frame answering a tokenize, or the `text` frame answering a detokenize; ApiError
    (400) naming the field for ids outside the vocabulary or text the tokenizer refuses. Blocking."""
    try:
        if isinstance(command, Tokenize):
            ids = tokenizer.encode(command.content, add_special=command.add_special)
            return {"v": PROTOCOL_VERSION, "type": "tokens", "id": command.request_id, "tokens": ids}
        outside = next((token for token in command.tokens if token >= tokenizer.n_vocab), None)
        if outside is not None:
            raise ApiError.invalid("tokens", f"tokens holds token id {outside}; the vocabulary has ids "
                                   f"0..{tokenizer.n_vocab - 1}")
        return {"v": PROTOCOL_VERSION, "type": "text", "id": command.request_id,
                "content": tokenizer.decode(command.tokens)}
    except TokenizerError as exc:
        param = "content" if isinstance(command, Tokenize) else "tokens"
        raise ApiError.invalid(param, f"{param}: {exc}") from None


def _waiting_ids(value: Any) -> tuple[str, ...]:
    """A ping's `waiting` list: up to MAX_WAITING_IDS request ids; ApiError (400) otherwise."""
    if not isinstance(value, list) or len(value) > MAX_WAITING_IDS:
        raise ApiError.invalid("waiting", f"waiting must be a list of at most {MAX_WAITING_IDS} request ids, "
                               f"got {value!r:.80}")
    ids = tuple(readable_id({"id": item}) for item in value)
    if any(request_id is None for request_id in ids):
        raise ApiError.invalid("waiting", f"waiting holds ids of 1 to {MAX_ID_CHARS} characters, got {value!r:.80}")
    return tuple(request_id for request_id in ids if request_id is not None)


def error_frame(request_id: str | None, error: ApiError, *, refused: bool = False) -> JsonObject:
    """The `error` frame answering `error` (with `retry_after_s` for 429 and 503). `refused`:
    it answers a message that started nothing, so a running request with the same id (the
    409 case) goes on; the frame says so with `"refused": true`."""
    kind = error.code or _DEFAULT_KINDS.get(error.status, "internal_error")
    frame: JsonObject = {"v": PROTOCOL_VERSION, "type": "error", "id": request_id, "code": error.status,
                         "error": kind, "message": error.message, "param": error.param}
    if refused:
        frame["refused"] = True
    if error.retry_after_s is not None:
        frame["retry_after_s"] = error.retry_after_s
    return frame


@attrs.frozen
class FrameShape:
    """What a request's frames carry beyond version 1's first fields (docs/PROTOCOL.md §8.3):
    `choice` and `choices` when it asked for more than one choice; `logprobs` when it asked for
    them, in its deltas when `streamed`, else in its final frame (never both: at long contexts
    they are most of the bytes, and a client's send budget bounds what may wait for it)."""

    choices: bool = False
    logprobs: bool = False
    streamed: bool = True
    tools: ToolAnswers | None = None  # a request with tools: the final frame reads the text for calls
    reasoning: ReasoningReader | None = None  # a thinking template: the final frame reads the thought apart

    @classmethod
    def of(cls, params: CompletionParams, tools: ToolAnswers | None = None,
           reasoning: ReasoningReader | None = None) -> FrameShape:
        """The shape of a request's frames."""
        return cls(choices=params.n > 1, logprobs=params.logprobs is not None, streamed=params.stream, tools=tools,
                   reasoning=reasoning)


_EMBEDDING_ENTRY_BYTES = 40  # `{"index":2047,"embedding":[]},` and the quotes of a base64 text
_EMBEDDING_FRAME_BYTES = 400  # the frame's other fields: v, type, id (128 characters), model, usage
_FLOAT_BYTES = 15  # the longest shortest-float32 text of a value, with its comma: -1.1754944e-38,


def embedding_frame_bytes(count: int, n_embd: int, encoding_format: str) -> int:
    """An upper bound of the bytes of the `embedding` frame answering `count` inputs of `n_embd` values."""
    vector = 4 * math.ceil(4 * n_embd / 3) if encoding_format == "base64" else _FLOAT_BYTES * n_embd
    return _EMBEDDING_FRAME_BYTES + count * (_EMBEDDING_ENTRY_BYTES + vector)


def check_embedding_size(params: EmbeddingParams, n_embd: int | None, max_bytes: int) -> None:
    """ApiError 400 naming `input` when the answer could take more than half a client's send budget of
    `max_bytes`: the other half is for the frames counted against the budget meanwhile (the last ones
    libzmq took, the client's other requests'); past the budget the client is cut off (docs/PROTOCOL.md
    §8.1), so such a request must ask for fewer inputs."""
    if n_embd is None:
        return  # the width is not known: nothing to bound
    count, room = len(params.inputs), max_bytes // 2
    bound = embedding_frame_bytes(count, n_embd, params.encoding_format)
    if bound <= room:
        return
    fits = {form: (room - _EMBEDDING_FRAME_BYTES) // (embedding_frame_bytes(1, n_embd, form) - _EMBEDDING_FRAME_BYTES)
            for form in ("float", "base64")}
    raise ApiError.invalid("input", f"input holds {count} inputs of {n_embd} values each: their embedding frame "
                           f"may take {bound} bytes, above half of a client's send budget of {max_bytes} bytes; "
                           f"send at most {fits['float']} inputs per embed as floats, or {fits['base64']} with "
                           "encoding_format base64")


def _float32_text(vector: npt.NDArray[np.float32]) -> list[float]:
    """A vector's values as the shortest decimals that read back as the same float32s (as logprobs are)."""
    return [float(str(value)) for value in np.asarray(vector, dtype=np.float32)]


@attrs.define(eq=False)
class EmbeddingGather:
    """The finished runs of one embed request, by input index, until every input has its vector."""

    params: EmbeddingParams
    count: int
    results: dict[int, GenerationResult] = attrs.Factory(dict)

    def take(self, index: int, event: Event) -> ApiError | bool:
        """Take input `index`'s event: True once every input has its vector, False while some wait, the
        ApiError that ends the request when a run failed (the others are then to be cancelled)."""
        if isinstance(event, Failed):
            return ApiError.from_exception(event.error)
        if not isinstance(event, Done):
            return False  # an embedding run generates nothing: no delta carries anything
        if event.result.embedding is None:
            return ApiError(500, f"the engine finished input {index} of an embedding request without its vector",
                            kind="server_error", code="internal_error")
        self.results[index] = event.result
        return len(self.results) == self.count

    @property
    def prompt_tokens(self) -> int:
        """Tokens of every input: what the request's usage counts."""
        return sum(len(result.prompt_ids) for result in self.results.values())

    def frame(self, request_id: str, model_id: str) -> JsonObject:
        """The `embedding` frame: every input's vector in input order, as floats or base64 (blocking:
        a few seconds for the largest requests, so built off the loop)."""
        data = []
        for index in range(self.count):
            vector = self.results[index].embedding
            assert vector is not None  # take() refuses a result without its vector
            value = self.params.encoded(vector) if self.params.encoding_format == "base64" else _float32_text(vector)
            data.append({"index": index, "embedding": value})
        tokens = self.prompt_tokens
        return {"v": PROTOCOL_VERSION, "type": "embedding", "id": request_id, "data": data, "model": model_id,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@attrs.define(eq=False)
class PendingRequest:
    """One outstanding request of one client."""

    identity: bytes
    request_id: str
    stream: bool
    opened: float  # clock time the request arrived
    slot: ClientSlot | None = None  # its place under the per-client cap, released when it leaves the table
    deadline: float = float("inf")  # clock time after which the API ends it itself (504)
    engine: EngineLike | None = None
    tickets: list[Any] = attrs.Factory(list)  # the engine's, one per run (an embed's: one per input); none
    # while the prompt is being tokenized
    cancelled: bool = False
    last_token: float | None = None  # clock time of the latest tokens (for the latency metrics)
    shape: FrameShape = FrameShape()  # what its frames carry
    gather: EmbeddingGather | None = None  # an embed's vectors as its inputs finish

    def tokens(self, count: int, now: float, metrics: GatewayMetrics) -> None:
        """Observe `count` new tokens in the latency histograms."""
        if not count:
            return
        if self.last_token is None:
            metrics.first_token(now - self.opened)
            if count > 1:
                metrics.inter_token(0.0, count - 1)
        else:
            metrics.inter_token(now - self.last_token, count)
        self.last_token = now

    def cancel(self) -> None:
        """Ask the engine to end the request, every run of it (idempotent); it ends with Failed(RequestCancelled)."""
        self.cancelled = True
        if self.engine is not None:
            for ticket in self.tickets:
                self.engine.cancel(ticket)


class ClientTable:
    """Outstanding requests by (client identity, request id) and when each client was last heard.

    A client is tracked only while it has outstanding requests, so idle clients cost nothing. The
    per-client cap is `limiter`'s (default: one of `max_per_client`), keyed by the `client` string
    `open` is given (default: the routing id), so several connections may count as one client.
    """

    def __init__(self, silence_s: float = CLIENT_SILENCE_S, max_per_client: int | None = None, *,
                 limiter: ClientLimiter | None = None) -> None:
        self.silence_s = silence_s
        self.limiter = limiter if limiter is not None else ClientLimiter(max_per_client)
        self._requests: dict[bytes, dict[str, PendingRequest]] = {}
        self._heard: dict[bytes, float] = {}

    def __len__(self) -> int:
        return sum(len(requests) for requests in self._requests.values())

    def heard(self, identity: bytes, now: float) -> None:
        """Any message from a client proves it alive."""
        if identity in self._heard:
            self._heard[identity] = now

    def open(self, identity: bytes, request_id: str, now: float, *, stream: bool,
             client: str | None = None, shape: FrameShape = FrameShape()) -> PendingRequest:
        """Track a new request; ApiError 409 for a running id, 429 over the per-client cap."""
        requests = self._requests.get(identity, {})
        if request_id in requests:
            raise ApiError(409, f"request id {request_id!r} is still running; ids must be unique among "
                           "a client's outstanding requests", param="id", code="duplicate_id")
        slot = self.limiter.acquire(client if client is not None else identity.hex())
        entry = PendingRequest(identity, request_id, stream, now, slot, shape=shape)
        self._requests.setdefault(identity, {})[request_id] = entry
        self._heard[identity] = now
        return entry

    def get(self, identity: bytes, request_id: str) -> PendingRequest | None:
        """The outstanding request, or None."""
        return self._requests.get(identity, {}).get(request_id)

    def is_open(self, entry: PendingRequest) -> bool:
        """Whether `entry` is still outstanding (not ended, not forgotten with its client)."""
        return self.get(entry.identity, entry.request_id) is entry

    def close(self, entry: PendingRequest) -> None:
        """The request ended; a client left with none is forgotten."""
        requests = self._requests.get(entry.identity)
        if requests is not None and requests.get(entry.request_id) is entry:
            del requests[entry.request_id]
            _release(entry)
            if not requests:
                del self._requests[entry.identity]
                del self._heard[entry.identity]

    def silent(self, now: float) -> list[bytes]:
        """Clients with outstanding requests not heard from for longer than `silence_s`."""
        return [identity for identity, heard in self._heard.items() if now - heard > self.silence_s]

    def overdue(self, now: float) -> list[PendingRequest]:
        """Requests past their deadline."""
        return [entry for requests in self._requests.values() for entry in requests.values() if now > entry.deadline]

    def forget(self, identity: bytes) -> list[PendingRequest]:
        """Drop a client (gone or silent) and return its outstanding requests."""
        self._heard.pop(identity, None)
        entries = list(self._requests.pop(identity, {}).values())
        for entry in entries:
            _release(entry)
        return entries

    def identities(self) -> list[bytes]:
        """Every client with outstanding requests."""
        return list(self._requests)


def _release(entry: PendingRequest) -> None:
    if entry.slot is not None:
        entry.slot.release()


def info_frame(backend: GatewayState, client_silence_s: float) -> JsonObject:
    """The `info` frame: what the gateway serves and its protocol limits."""
    return {
        "v": PROTOCOL_VERSION, "type": "info", "model": backend.model_id, "ctx_size": backend.ctx_size,
        "ready": backend.health()[0], "versions": list(SUPPORTED_VERSIONS), "max_frame_bytes": MAX_FRAME_BYTES,
        "client_silence_s": client_silence_s,
    }


def with_id(frame: JsonObject, request_id: str | None) -> JsonObject:
    return frame if request_id is None else {**frame, "id": request_id}


def pong_frames(command: Ping, ready: bool, holds: Callable[[str], bool]) -> list[JsonObject]:
    """The answer to a ping: the pong, then a 404 `unknown_request` for every request the client
    waits on that this gateway does not hold (it restarted, or the request ended and its frames
    were lost), so that wait ends too (docs/PROTOCOL.md §8.2)."""
    frames = [with_id({"v": PROTOCOL_VERSION, "type": "pong", "ready": ready}, command.request_id)]
    for lost in command.waiting:
        if not holds(lost):
            gone = ApiError(404, f"request {lost!r} is not running on this gateway; it ended or the gateway "
                            "restarted", param="id", code="unknown_request")
            frames.append(error_frame(lost, gone))
    return frames


def _logprob(value: float) -> float | None:
    """A float32 logprob as the shortest decimal that reads back as the same float32 (half the
    digits of its float64 form). JSON has no infinities: minus infinity (a token of probability 0)
    goes out as null."""
    return float(str(np.float32(value))) if math.isfinite(value) else None


def logprobs_json(items: Sequence[TokenLogprobs]) -> list[JsonObject]:
    """Token logprobs as frames carry them: ids, not text (the client has no tokenizer)."""
    return [{"token": item.token, "logprob": _logprob(item.logprob),
             "top": [[token, _logprob(logprob)] for token, logprob in item.top]} for item in items]


def delta_frame(request_id: str, delta: Delta, shape: FrameShape = FrameShape()) -> JsonObject:
    """A streamed request's new text and tokens (of one choice)."""
    frame: JsonObject = {"v": PROTOCOL_VERSION, "type": "delta", "id": request_id, "text": delta.text,
                         "token_ids": list(delta.token_ids)}
    if shape.choices:
        frame["choice"] = delta.choice
    if shape.logprobs and shape.streamed:
        frame["logprobs"] = logprobs_json(delta.logprobs)
    return frame


def _choice_fields(result: GenerationResult, *, logprobs: bool, shape: FrameShape) -> JsonObject:
    tools, reasoning = shape.tools, shape.reasoning
    thought, rest = reasoning.split(result.text) if reasoning is not None else (None, result.text)
    parsed = tools.parse(rest) if tools is not None and result.finish_reason != "length" else None
    calls = parsed.calls if parsed is not None else ()
    fields: JsonObject = {"finish_reason": finish_reason(result.finish_reason, called=bool(calls)),
                          "text": result.text, "token_ids": list(result.tokens)}
    if thought:  # `text` stays the whole answer: `content` is what is not thought (nor a call)
        fields |= {"reasoning_content": thought, "content": rest}
    if parsed is not None and calls:
        fields |= {"content": parsed.content, "tool_calls": [call.as_json() for call in calls]}
    if logprobs:
        fields["logprobs"] = logprobs_json(result.logprobs)
    return fields


def final_frame(request_id: str, results: Sequence[GenerationResult], model_id: str,
                shape: FrameShape = FrameShape()) -> JsonObject:
    """A finished request: its first choice's whole text and tokens (version 1's fields), why it
    stopped, its usage; with `n` > 1 every choice; the logprobs of a request not streamed."""
    logprobs = shape.logprobs and not shape.streamed
    first = _choice_fields(results[0], logprobs=logprobs and not shape.choices,  # with n > 1: in `choices` only
                           shape=shape)
    frame: JsonObject = {"v": PROTOCOL_VERSION, "type": "final", "id": request_id, **first,
                         "usage": Usage.of_all(results).as_dict(), "model": model_id}
    if shape.choices:
        frame["choices"] = [{"index": result.choice, **_choice_fields(result, logprobs=logprobs, shape=shape)}
                            for result in results]
    return frame


@attrs.frozen
class Refused:
    """A client message that starts nothing: the error to answer, and the request id it named if any."""

    request_id: str | None
    error: ApiError


def read_command(frame_count: int, data: bytes | None, defaults: SamplingDefaults = NO_DEFAULTS) -> Command | Refused:
    """One client message (its frame count after the routing id, and its first frame) as a command,
    or what to refuse it with (`defaults`: the server's sampling defaults)."""
    request_id: str | None = None
    try:
        check_frame_count(frame_count)
        assert data is not None  # one frame
        document = _parse_frame(data)
        request_id = readable_id(document.value)
        return parse_command(_checked(document), defaults)
    except ApiError as exc:
        return Refused(request_id, exc)
