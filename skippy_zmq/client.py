"""The Python client of the gateway's ZeroMQ request API (docs/PROTOCOL.md §8).

`Client` is synchronous: one DEALER socket, one thread. It sends one JSON frame per request,
reads the request's `delta` frames and its one `final` or `error` frame, pings the gateway
while it waits (a ROUTER cannot see a DEALER go away, §8.5) and cancels a request it stops
reading; a gateway that answers none of its pings for 3 intervals is taken for dead
(`GatewayUnavailable`). The frame constants and value classes are the protocol's
(`wire/request_api.py`), shared with the gateway, so both sides agree by construction.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import zmq

from skippy_zmq.errors import (
    GatewayError,
    GatewayTimeout,
    GatewayUnavailable,
    RequestError,
    WireError,
)
from skippy_zmq.security.curve import curve_client
from skippy_zmq.security.keys import KeyPair
from skippy_zmq.tcp import keep_alive
from skippy_zmq.wire.request_api import (
    MAX_FRAME_BYTES,
    MAX_WAITING_IDS,
    PROTOCOL_VERSION,
    RESERVED_FIELDS,
    Completion,
    Embeddings,
    GatewayInfo,
    JsonObject,
    StreamDelta,
    TokenLogprob,
    content_from_frame,
    encode_frame,
    error_from_frame,
    tokens_from_frame,
)

DEFAULT_TIMEOUT_S = 60.0
"""Longest silence of the gateway (no frame at all, pongs included) a waiting request bears,
unless `GONE_AFTER_PINGS` ping intervals are shorter (they are by default: 15 s).

A request queued behind others keeps waiting as long as the gateway answers the client's
pings; the gateway's own request timeout and queue bound how long it is held there."""
DEFAULT_HEARTBEAT_S = 5.0
"""Ping interval of a waiting client: a third of the gateway's default client silence."""
GONE_AFTER_PINGS = 3
"""Ping intervals without any frame from the gateway after which a waiting client takes it for gone.

A live gateway answers every ping at once, so this long a silence while pinging means it is dead
or unreachable; it is the gateway's own rule for its clients, mirrored (three intervals, §8.5)."""

_T = TypeVar("_T")


@attrs.frozen
class SilenceRule:
    """How long a waiting request bears a gateway that sends nothing at all (pongs included):
    `timeout_s`, or `GONE_AFTER_PINGS` ping intervals if that is sooner."""

    timeout_s: float
    heartbeat_s: float

    @property
    def limit_s(self) -> float:
        """The longest silence borne."""
        return min(self.timeout_s, self.gone_after_s)

    @property
    def gone_after_s(self) -> float:
        """The silence after which the gateway is taken for gone."""
        return GONE_AFTER_PINGS * self.heartbeat_s

    def error(self, endpoint: str, request_id: str, pings: int, hint: str = "") -> GatewayError:
        """What ends a wait that reached `limit_s`: GatewayUnavailable when the gateway answered none
        of the client's `pings` for `GONE_AFTER_PINGS` intervals, else GatewayTimeout."""
        if self.gone_after_s < self.timeout_s:
            return GatewayUnavailable(
                f"gateway {endpoint} answered none of the {pings} pings sent in {self.gone_after_s:g} s "
                f"({GONE_AFTER_PINGS} ping intervals of {self.heartbeat_s:g} s) while request {request_id!r} "
                f"waited: it is gone or unreachable{hint}", code=503, kind="gateway_gone", request_id=request_id,
            )
        return GatewayTimeout(
            f"gateway {endpoint} sent nothing, not even a pong, for {self.timeout_s:g} s while "
            f"request {request_id!r} waited{hint}", code=504, kind="no_reply", request_id=request_id,
        )


class Client:
    """Synchronous client of a gateway's ZeroMQ request API; not thread-safe (one per thread)."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        server_key: str | bytes | os.PathLike[str] | None = None,
        client_keys: str | os.PathLike[str] | None = None,
    ) -> None:
        """A client of the request API at `endpoint`. With CURVE on the gateway, `server_key` is
        its public key (Z85 text, or the path of the driver's public `.key` file) and
        `client_keys` the path of this client's `.key_secret` file, whose public key the
        gateway admits (`skippy-zmq keygen --topology FILE --client NAME`; docs/PROTOCOL.md §10)."""
        self.endpoint = endpoint
        self.timeout_s = _seconds("timeout_s", timeout_s)
        self.heartbeat_s = _seconds("heartbeat_s", heartbeat_s)
        self._silence = SilenceRule(timeout_s, heartbeat_s)
        self._sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)  # a request's frames are bounded by its max_tokens
        keep_alive(self._sock)
        self._curve = server_key is not None or client_keys is not None
        try:
            if self._curve:
                _use_curve(self._sock, server_key, client_keys)
        except BaseException:
            self._sock.close(linger=0)
            raise
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._inbox: dict[str, deque[JsonObject]] = {}  # frames of outstanding requests, in order
        self._last_sent = time.monotonic()
        self._last_heard = 0.0  # when the gateway last sent any frame (monotonic clock)
        self._unanswered = 0  # pings sent since the gateway's last frame
        self._closed = False

    # --- public API ---------------------------------------------------------------------------

    def complete(self, prompt: str | Sequence[int], **params: Any) -> Completion:
        """Complete `prompt` (text or token ids); params are the /v1/completions fields (`logprobs=k`,
        `n`, `presence_penalty`, `frequency_penalty`, `logit_bias={token id: bias}`, ...)."""
        return self._collect("completion", {"prompt": _prompt_json(prompt)}, params)

    def stream(self, prompt: str | Sequence[int], **params: Any) -> Iterator[StreamDelta]:
        """Stream the completion of `prompt`; leaving the iteration early cancels the request."""
        return self._stream("completion", {"prompt": _prompt_json(prompt)}, params)

    def chat(self, messages: Sequence[Mapping[str, Any]], **params: Any) -> Completion:
        """Answer a chat; params are the /v1/chat/completions fields (`logprobs=True, top_logprobs=k`, ...)."""
        return self._collect("chat", {"messages": [dict(m) for m in messages]}, params)

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], **params: Any) -> Iterator[StreamDelta]:
        """Stream the answer to a chat; leaving the iteration early cancels the request."""
        return self._stream("chat", {"messages": [dict(m) for m in messages]}, params)

    def tokenize(self, text: str, *, add_special: bool = False) -> tuple[int, ...]:
        """The token ids of `text` with the served model's tokenizer; `add_special` adds the BOS a
        prompt starts with, so `tokenize(p, add_special=True)` are the ids `complete(p)` runs on."""
        frame = {"v": PROTOCOL_VERSION, "type": "tokenize", "content": text, "add_special": add_special}
        return self._ask(frame, "tokens", tokens_from_frame)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids` with the served model's tokenizer."""
        frame = {"v": PROTOCOL_VERSION, "type": "detokenize", "tokens": [int(token) for token in token_ids]}
        return self._ask(frame, "text", content_from_frame)

    def embed(self, inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], *,
              encoding_format: str = "float", model: str | None = None, dimensions: int | None = None,
              timeout_s: float | None = None) -> Embeddings:
        """The embeddings of `inputs` (a text, texts, token ids, or lists of token ids: the `/v1/embeddings`
        `input`), one vector per input; `encoding_format` "base64" is decoded here (the same float32s in
        fewer bytes). `timeout_s` bounds this wait's silence instead of the client's `timeout_s`."""
        optional = {name: value for name, value in (("model", model), ("dimensions", dimensions)) if value is not None}
        frame = {"v": PROTOCOL_VERSION, "type": "embed", "input": _input_json(inputs),
                 "encoding_format": encoding_format, **optional}
        silence = None if timeout_s is None else SilenceRule(_seconds("timeout_s", timeout_s), self.heartbeat_s)
        return self._ask(frame, "embedding", Embeddings.from_frame, silence)

    def info(self) -> GatewayInfo:
        """The gateway's model, context size, readiness and protocol limits."""
        return self._ask({"v": PROTOCOL_VERSION, "type": "info"}, "info", GatewayInfo.from_frame)

    def close(self) -> None:
        """Close the socket at once (linger 0); outstanding requests end by the gateway's silence rule."""
        if not self._closed:
            self._closed = True
            self._sock.close(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- requests -----------------------------------------------------------------------------

    def _collect(self, kind: str, payload: JsonObject, params: Mapping[str, Any]) -> Completion:
        request_id = self._begin(*self._prepare(_request_frame(kind, payload, params)))
        done = False
        streamed: dict[int, list[TokenLogprob]] = {}  # by choice: a streamed final frame has no logprobs
        try:
            while True:
                frame = self._next_frame(request_id)
                if frame["type"] == "final":
                    done = True
                    return _parsed(Completion.from_frame, frame, self.endpoint).with_streamed_logprobs(streamed)
                if frame["type"] == "error":
                    done = True
                    raise error_from_frame(frame)
                if frame["type"] != "delta":
                    raise WireError(f"gateway {self.endpoint}: unexpected {frame['type']!r} frame for {request_id!r}")
                # otherwise deltas only restart the deadline: the final frame carries the whole text
                if "logprobs" in frame:
                    delta = _parsed(StreamDelta.from_frame, frame, self.endpoint)
                    streamed.setdefault(delta.choice, []).extend(delta.logprobs or ())
        finally:
            self._finish(request_id, cancel=not done)

    def _ask(self, frame: JsonObject, kind: str, builder: Callable[[JsonObject], _T],
             silence: SilenceRule | None = None) -> _T:
        """Send `frame` and return its one answer, a `kind` frame, built; its error frame raised.
        `silence`: this wait's rule instead of the client's."""
        request_id = self._begin(*self._prepare(frame))
        answer: JsonObject | None = None
        try:
            answer = self._next_frame(request_id, silence)
        finally:
            # an abandoned tokenize or embed is an outstanding request at the gateway; an info is not
            self._finish(request_id, cancel=answer is None and kind != "info")
        if answer["type"] == "error":
            raise error_from_frame(answer)
        if answer["type"] != kind:
            raise WireError(f"gateway {self.endpoint}: expected a {kind!r} frame for {request_id!r}, "
                            f"got {answer['type']!r}")
        return _parsed(builder, answer, self.endpoint)

    def _stream(self, kind: str, payload: JsonObject, params: Mapping[str, Any]) -> Iterator[StreamDelta]:
        if "stream" in params:
            raise RequestError("stream(): the stream parameter is set by the method; leave it out")
        # checked now, sent at the first next(): a stream never iterated leaves nothing running
        return self._deltas(*self._prepare(_request_frame(kind, payload, params)))

    def _deltas(self, request_id: str, data: bytes) -> Iterator[StreamDelta]:
        self._begin(request_id, data)
        done = asked = False
        try:
            while True:
                frame = self._next_frame(request_id)
                if frame["type"] == "delta":
                    delta = _parsed(StreamDelta.from_frame, frame, self.endpoint)
                    asked = asked or delta.logprobs is not None
                    yield delta
                elif frame["type"] == "final":
                    done = True
                    yield from StreamDelta.closing(_parsed(Completion.from_frame, frame, self.endpoint), logprobs=asked)
                    return
                elif frame["type"] == "error":
                    done = True
                    raise error_from_frame(frame)
                else:
                    raise WireError(f"gateway {self.endpoint}: unexpected {frame['type']!r} frame for {request_id!r}")
        finally:
            self._finish(request_id, cancel=not done)

    def _prepare(self, frame: JsonObject) -> tuple[str, bytes]:
        """A fresh id and the encoded frame, checked against the frame limit."""
        request_id = str(next(self._ids))
        data = encode_frame({**frame, "id": request_id})
        if len(data) > MAX_FRAME_BYTES:
            raise RequestError(
                f"request frame of {len(data)} bytes exceeds the request API's limit of {MAX_FRAME_BYTES} bytes"
            )
        return request_id, data

    def _begin(self, request_id: str, data: bytes) -> str:
        """Send a request frame; its frames are collected from now on."""
        if self._closed:
            raise GatewayUnavailable(f"client of {self.endpoint} is closed", code=503, kind="client_closed")
        self._inbox[request_id] = deque()
        try:
            self._send(data)
        except GatewayError:
            del self._inbox[request_id]
            raise
        return request_id

    def _finish(self, request_id: str, *, cancel: bool) -> None:
        self._inbox.pop(request_id, None)
        if cancel and not self._closed:
            self._send(encode_frame({"v": PROTOCOL_VERSION, "type": "cancel", "id": request_id}))

    # --- frames -------------------------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        # a DEALER queues on its connect-time pipe; a full queue means the gateway is unreachable
        try:
            self._sock.send(data, flags=zmq.DONTWAIT)
        except zmq.Again as exc:
            raise GatewayUnavailable(
                f"gateway {self.endpoint} does not take frames (unreachable){_curve_hint(self._curve)}", code=503,
                kind="unreachable",
            ) from exc
        self._last_sent = time.monotonic()

    def _next_frame(self, request_id: str, silence: SilenceRule | None = None) -> JsonObject:
        """The request's next frame, pinging while waiting; once the gateway has sent nothing at all
        (not even a pong) for the silence rule's limit, GatewayUnavailable (gone) or GatewayTimeout."""
        rule = silence or self._silence
        box = self._inbox[request_id]
        waiting_since = time.monotonic()
        while not box:
            now = time.monotonic()
            deadline = max(waiting_since, self._last_heard) + rule.limit_s
            if now >= deadline:
                raise rule.error(self.endpoint, request_id, self._unanswered, _curve_hint(self._curve))
            if now - self._last_sent >= self.heartbeat_s:
                self._ping()
            wait_s = min(deadline, self._last_sent + self.heartbeat_s) - time.monotonic()
            if self._sock.poll(max(1, math.ceil(wait_s * 1000)), zmq.POLLIN):
                self._receive_ready()
        if time.monotonic() - self._last_sent >= self.heartbeat_s:
            # a consumer that holds each delta for a while still keeps its requests alive
            self._ping()
        return box.popleft()

    def _ping(self) -> None:
        """A heartbeat naming the requests waited on: the gateway answers a pong, and a 404
        error frame for any of them it does not hold, so no wait outlives the request."""
        waiting = list(self._inbox)[:MAX_WAITING_IDS]
        self._send(encode_frame({"v": PROTOCOL_VERSION, "type": "ping", "waiting": waiting}))
        self._unanswered += 1

    def _receive_ready(self) -> None:
        """Read every frame waiting on the socket into the inboxes of their requests."""
        while True:
            try:
                data = self._sock.recv(flags=zmq.DONTWAIT)
            except zmq.Again:
                return
            frame = _decode(data, self.endpoint)
            self._last_heard = time.monotonic()
            self._unanswered = 0
            request_id = frame.get("id")
            if isinstance(request_id, str) and request_id in self._inbox:
                self._inbox[request_id].append(frame)
            # pongs and frames of requests already given up are dropped


def _request_frame(kind: str, payload: JsonObject, params: Mapping[str, Any]) -> JsonObject:
    clash = sorted(RESERVED_FIELDS.intersection(params))
    if clash:
        raise RequestError(f"request parameters may not set {', '.join(clash)}: the client sets them")
    bias = params.get("logit_bias")
    if isinstance(bias, Mapping):  # JSON object keys are strings; numpy ids have no JSON form
        params = {**params, "logit_bias": {_token_key(token): value for token, value in bias.items()}}
    return {"v": PROTOCOL_VERSION, "type": kind, **payload, **params}


def _token_key(token: Any) -> str:
    """A logit_bias key as JSON writes it: a token id's digits (OpenAI's form); RequestError otherwise."""
    if isinstance(token, str):
        return token  # the gateway checks it
    try:
        return str(operator.index(token))
    except TypeError:
        raise RequestError(f"logit_bias: key {token!r:.80} is not a token id; keys are integers") from None


def _curve_hint(curve: bool) -> str:
    """A client without keys cannot complete a CURVE handshake, and ZeroMQ says nothing: name the cause."""
    if curve:
        return ""
    return ("; if the gateway requires CURVE keys ([security] curve = true), pass server_key and client_keys "
            "(docs/PROTOCOL.md §10)")


def _seconds(name: str, value: float) -> float:
    """A positive, finite number of seconds; RequestError naming `name` otherwise."""
    if not (isinstance(value, int | float) and not isinstance(value, bool) and value > 0 and math.isfinite(value)):
        raise RequestError(f"Client: {name} {value!r} must be a positive number of seconds")
    return float(value)


def _input_json(inputs: Any) -> str | list[Any]:
    """An embed's `input` as JSON writes it: a text as is; in a list, texts, token ids and lists of
    token ids (numpy integers too); RequestError naming what is neither (the gateway checks the rest)."""
    if isinstance(inputs, str):
        return inputs
    if not isinstance(inputs, Sequence) and not hasattr(inputs, "__array__"):
        raise RequestError(f"embed: input {inputs!r:.80} is not a text or a sequence of inputs")
    items: list[Any] = []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            items.append(item)
            continue
        try:
            items.append(operator.index(item) if not hasattr(item, "__len__") else [operator.index(t) for t in item])
        except TypeError:
            raise RequestError(f"embed: input[{index}] {item!r:.80} is not a text, a token id or a list of token "
                               "ids") from None
    return items


def _prompt_json(prompt: str | Sequence[int]) -> str | list[int]:
    return prompt if isinstance(prompt, str) else [int(token) for token in prompt]


def _parsed(builder: Callable[[JsonObject], _T], frame: JsonObject, endpoint: str) -> _T:
    """A value from a gateway frame; WireError when the frame lacks a field or has a wrong one."""
    try:
        return builder(frame)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int() of an infinity
        raise WireError(f"gateway {endpoint} sent a malformed {frame.get('type')!r} frame: {exc!r:.300}") from exc


def _decode(data: bytes, endpoint: str) -> JsonObject:
    try:
        frame = json.loads(data)
    except (ValueError, RecursionError) as exc:  # not UTF-8 or JSON, an integer of over 4,300 digits, deep nesting
        raise WireError(f"gateway {endpoint} sent a frame that is not JSON: {data[:80]!r}") from exc
    if not isinstance(frame, dict) or frame.get("v") != PROTOCOL_VERSION or not isinstance(frame.get("type"), str):
        raise WireError(f"gateway {endpoint} sent a frame that is not a version-{PROTOCOL_VERSION} object: "
                        f"{data[:80]!r}")
    return frame


def _use_curve(
    sock: zmq.Socket[bytes], server_key: str | bytes | os.PathLike[str] | None,
    client_keys: str | os.PathLike[str] | None,
) -> None:
    """Make `sock` a CURVE client (before connect); RequestError when half the keys are given."""
    if server_key is None or client_keys is None:
        given, missing = ("server_key", "client_keys") if client_keys is None else ("client_keys", "server_key")
        raise RequestError(f"Client: {given} needs {missing} too: CURVE takes the gateway's public key and "
                           "this client's .key_secret file")
    own = KeyPair.load(Path(client_keys), secret=True)
    if isinstance(server_key, (str, bytes)) and len(server_key) == 40 and not Path(os.fsdecode(server_key)).exists():
        server = server_key.encode() if isinstance(server_key, str) else server_key
    else:
        server = KeyPair.load(Path(os.fsdecode(server_key)), secret=False).public
    curve_client(sock, own, server)

