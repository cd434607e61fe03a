"""The ZeroMQ request API's frames, shared by the gateway and `skippy_zmq.Client`: version, limits,
JSON encoding, typed errors by code, and the value classes of its answers (docs/PROTOCOL.md §8).
No sockets.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeAlias

import attrs

from skippy_zmq.errors import (
    GatewayBusy,
    GatewayCancelled,
    GatewayError,
    GatewayRequestError,
    GatewayTimeout,
    GatewayUnavailable,
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

    @classmethod
    def from_json(cls, usage: Mapping[str, Any]) -> Usage:
        """From a final frame's `usage` object."""
        prompt, completion = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
        return cls(prompt, completion, int(usage.get("total_tokens", prompt + completion)))


@attrs.frozen
class Completion:
    """A finished request: its whole text and tokens, why it stopped, and its token counts."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    usage: Usage
    model: str = ""

    @classmethod
    def from_frame(cls, frame: Mapping[str, Any]) -> Completion:
        """From a `final` frame."""
        return cls(
            text=str(frame["text"]),
            token_ids=tuple(int(token) for token in frame["token_ids"]),
            finish_reason=str(frame["finish_reason"]),
            usage=Usage.from_json(frame["usage"]),
            model=str(frame.get("model", "")),
        )


@attrs.frozen
class StreamDelta:
    """New output of a streamed request; the last one carries `finish_reason` and `usage`."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    usage: Usage | None = None

    @classmethod
    def from_frame(cls, frame: Mapping[str, Any]) -> StreamDelta:
        """From a `delta` frame."""
        return cls(str(frame["text"]), tuple(int(token) for token in frame["token_ids"]))

    @classmethod
    def last(cls, completion: Completion) -> StreamDelta:
        """The closing delta of a stream: no new text, the finish reason and usage."""
        return cls("", (), completion.finish_reason, completion.usage)


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
