"""OpenAI-compatible request bodies, responses, stream chunks and errors; socket-free.

`CompletionParams.from_body` validates the JSON body of `POST /v1/completions` or
`POST /v1/chat/completions` into one frozen value; `CompletionParams.generation_request` checks
the tokenized prompt against the context and builds the engine's `GenerationRequest`;
`ResponseShape` builds the response objects and the server-sent-event chunks in OpenAI's
shapes; `ApiError` is an OpenAI error object with its HTTP status. The HTTP gateway and the
ZeroMQ request API share all of it, so both validate a request the same way.

Choices where OpenAI-compatible servers differ:
- An unknown field is a 400 naming it (as OpenAI does; vLLM ignores unknown fields).
- OpenAI fields that skippy-zmq does not implement are accepted only at their neutral value
  (`n` 1, `echo` false, `logprobs` false, `logit_bias` {}, `presence_penalty` 0, ...) and are a
  400 naming the field otherwise. `null` is the same as leaving a field out.
- `prompt_tokens + max_tokens` must fit the context, else 400 `context_length_exceeded` (as
  vLLM; llama-server clamps instead). Without `max_tokens`, chat generates up to the context
  and completions 16 tokens, clamped to the room the prompt leaves.
- One prompt per request: a list of several prompts is a 400.
"""

from __future__ import annotations

import enum
import json
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import attrs

from skippy_zmq.driver.generation import GenerationRequest, GenerationResult
from skippy_zmq.errors import (
    EngineUnavailable,
    QueueFull,
    RequestCancelled,
    RequestError,
    RequestJsonError,
    RequestTimeout,
    SkippyError,
    StageTimeout,
)
from skippy_zmq.gateway.request_json import OversizedInteger, RequestJson, shown
from skippy_zmq.runtime.sampling import SamplingParams

MAX_STOP_STRINGS = 4
"""Stop strings per request, OpenAI's limit."""
COMPLETION_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default `max_tokens` of /v1/completions."""
RETRY_AFTER_UNAVAILABLE_S = 5
RETRY_AFTER_QUEUE_FULL_S = 1
_MAX_TOKEN_ID = 2**31 - 1
MAX_TOKENS_BOUND = 2**31 - 1
"""Largest `max_tokens` accepted (an int32, as positions on the stage link, docs/PROTOCOL.md §2.2);
the context rule (§9.3) then bounds it by the room the prompt leaves."""
_SHOWN_CHARS = 80  # longest rendering of a client's value in an error message
_SEED_MASK = 2**64 - 1

JsonObject: TypeAlias = dict[str, Any]


class Endpoint(enum.Enum):
    """The two generation routes: their response object names and id prefixes."""

    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def object_name(self) -> str:
        """`object` of a whole response."""
        return "text_completion" if self is Endpoint.COMPLETIONS else "chat.completion"

    @property
    def chunk_object_name(self) -> str:
        """`object` of a stream chunk."""
        return "text_completion" if self is Endpoint.COMPLETIONS else "chat.completion.chunk"

    @property
    def id_prefix(self) -> str:
        """Prefix of response ids."""
        return "cmpl-" if self is Endpoint.COMPLETIONS else "chatcmpl-"


# --- errors -------------------------------------------------------------------------------------


class ApiError(SkippyError):
    """An error answered as an OpenAI error object `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = kind  # OpenAI's `type` field
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> JsonObject:
        """The JSON object of the response body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def invalid(cls, param: str | None, message: str, code: str | None = None) -> ApiError:
        """400: the request is malformed; `param` names the field."""
        return cls(400, message, param=param, code=code)

    @classmethod
    def too_large(cls, message: str) -> ApiError:
        """413 `request_too_large`: the body is above the gateway's limit."""
        return cls(413, message, code="request_too_large")

    @classmethod
    def context_length(cls, param: str, message: str) -> ApiError:
        """400 `context_length_exceeded`: the prompt (plus the requested tokens) does not fit."""
        return cls(400, message, param=param, code="context_length_exceeded")

    @classmethod
    def model_not_found(cls, model: str, served: str) -> ApiError:
        """404 `model_not_found`: the request names a model this server does not serve."""
        return cls(404, f"model {_shown(model)} does not exist here; this server serves {served!r}",
                   param="model", code="model_not_found")

    @classmethod
    def unavailable(cls, message: str) -> ApiError:
        """503: the pipeline is starting, draining or a stage is silent; retry later."""
        return cls(503, message, kind="service_unavailable_error", code="pipeline_unavailable",
                   retry_after_s=RETRY_AFTER_UNAVAILABLE_S)

    @classmethod
    def client_cap(cls, cap: int) -> ApiError:
        """429 `too_many_requests`: this client already has `cap` requests in flight (the per-client cap)."""
        return cls(429, f"this client has reached its cap of {cap} requests in flight (--max-client-requests); "
                   "wait for one to finish", kind="rate_limit_error",
                   code="too_many_requests", retry_after_s=RETRY_AFTER_QUEUE_FULL_S)

    @classmethod
    def unauthorized(cls, *, key_given: bool) -> ApiError:
        """401: the API key is missing or wrong (OpenAI's type and codes: `invalid_api_key` for a wrong key)."""
        if key_given:
            return cls(401, "Incorrect API key provided.", code="invalid_api_key")
        return cls(401, "You didn't provide an API key: send it in an Authorization header using Bearer auth "
                   "(Authorization: Bearer YOUR_KEY).")

    @classmethod
    def from_exception(cls, exc: SkippyError) -> ApiError:
        """The HTTP answer to an engine error, chosen by its class (never by its text)."""
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, RequestJsonError):
            return cls.invalid(exc.param, str(exc))
        for error_class, status, kind, code, retry in _ENGINE_ERRORS:
            if isinstance(exc, error_class):
                return cls(status, str(exc), kind=kind, code=code, retry_after_s=retry)
        return cls(500, str(exc), kind="server_error", code="internal_error")


# Most specific first: StageRefused is a StageTimeout; RequestError is the 400 of the engine.
_ENGINE_ERRORS: tuple[tuple[type[SkippyError], int, str, str | None, int | None], ...] = (
    (QueueFull, 429, "rate_limit_error", "queue_full", RETRY_AFTER_QUEUE_FULL_S),
    (EngineUnavailable, 503, "service_unavailable_error", "pipeline_unavailable", RETRY_AFTER_UNAVAILABLE_S),
    (StageTimeout, 503, "service_unavailable_error", "pipeline_unavailable", RETRY_AFTER_UNAVAILABLE_S),
    (RequestTimeout, 504, "timeout_error", "request_timeout", None),
    (RequestCancelled, 499, "cancelled_error", "request_cancelled", None),
    (RequestError, 400, "invalid_request_error", None, None),
)


# --- field checks -------------------------------------------------------------------------------

_Check: TypeAlias = Callable[[Any, str], Any]
"""(value, field name) -> parsed value; raises ApiError naming the field."""


def _shown(value: object) -> str:
    """A client's value in an error message: its repr (lone surrogates escaped), cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(low: int, high: int | None = None) -> _Check:
    def check(value: Any, name: str) -> int:
        if not _is_int(value) or value < low or (high is not None and value > high):
            upper = "" if high is None else f" and <= {high}"
            raise ApiError.invalid(name, f"{name} must be an integer >= {low}{upper}, got {_shown(value)}")
        return int(value)

    return check


def _number(low: float, high: float, *, low_open: bool = False) -> _Check:
    def check(value: Any, name: str) -> float:
        if not _is_number(value) or value > high or value < low or (low_open and value == low):
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise ApiError.invalid(name, f"{name} must be a number in {interval}, got {_shown(value)}")
        return float(value)

    return check


def _boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ApiError.invalid(name, f"{name} must be true or false, got {_shown(value)}")
    return value


def _string(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise ApiError.invalid(name, f"{name} must be a string, got {_shown(value)}")
    return value


def _neutral(accepts: Callable[[Any], bool], neutral: str) -> _Check:
    """A field skippy-zmq does not implement: only its neutral value (or null) is accepted."""

    def check(value: Any, name: str) -> Any:
        if not accepts(value):
            raise ApiError.invalid(
                name, f"{name} {json.dumps(value, default=repr)[:_SHOWN_CHARS]} is not supported; only {neutral} "
                "(or null) is accepted"
            )
        return value

    return check


def _penalty(value: Any, name: str) -> float:
    """OpenAI's presence/frequency penalties: the sampler has neither, so only 0 is accepted."""
    if not _is_number(value) or value != 0:
        raise ApiError.invalid(
            name, f"{name} {_shown(value)} is not supported: the sampler has no {name.replace('_', ' ')}; "
            f"only 0 is accepted (repeat_penalty is available)",
        )
    return 0.0


def _seed(value: Any, name: str) -> int:
    if not _is_int(value) or not -(2**63) <= value <= _SEED_MASK:
        raise ApiError.invalid(name, f"{name} must be an integer in [-2**63, 2**64), got {_shown(value)}")
    return int(value) & _SEED_MASK  # a negative int64 seed wraps, as its two's complement bits


def _stop(value: Any, name: str) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
        raise ApiError.invalid(name, f"{name} must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError.invalid(name, f"{name} has {len(stops)} strings; at most {MAX_STOP_STRINGS} are accepted")
    return tuple(stop for stop in stops if stop)


def _stream_options(value: Any, name: str) -> bool:
    if not isinstance(value, dict):
        raise ApiError.invalid(name, f"{name} must be an object")
    for key, item in value.items():
        if key not in ("include_usage", "include_obfuscation"):
            raise ApiError.invalid(f"{name}.{shown(key)}", f"unknown field {name}.{shown(key)}")
        if item is not None:
            _boolean(item, f"{name}.{key}")
    return bool(value.get("include_usage"))


REPEAT_PENALTY_RANGE = (1e-6, 1e6)
"""Accepted repeat_penalty values: positive, and far inside float32's range."""


def _top_k(value: Any, name: str) -> int:
    # The stage link carries top_k as an int32 (docs/PROTOCOL.md §2.2).
    return 0 if value == -1 and _is_int(value) else _integer(0, 2**31 - 1)(value, name)


def _prompt(value: Any, name: str) -> str | tuple[int, ...]:
    """A string, a list of token ids, or a list holding exactly one of those."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ApiError.invalid(name, f"{name} must be a string or a non-empty list of token ids")
    if all(_is_int(item) or isinstance(item, OversizedInteger) for item in value):
        bad = [item for item in value if not _is_int(item) or not 0 <= item <= _MAX_TOKEN_ID]
        if bad:
            raise ApiError.invalid(name, f"{name} holds token id {_shown(bad[0])}; token ids are integers in "
                                   f"[0, {_MAX_TOKEN_ID}]")
        return tuple(value)
    if all(isinstance(item, (str, list)) for item in value):
        raise ApiError.invalid(name, f"{name} holds {len(value)} prompts; send one request per prompt (n = 1)")
    raise ApiError.invalid(name, f"{name} must be a string or a list of token ids")


def _messages(value: Any, name: str) -> tuple[Mapping[str, Any], ...]:
    """A non-empty list of objects; roles and contents are checked when the chat is rendered."""
    if not isinstance(value, list) or not value:
        raise ApiError.invalid(name, f"{name} must be a non-empty list of message objects")
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise ApiError.invalid(f"{name}[{index}]", f"{name}[{index}] must be an object")
    return tuple(value)


_BOTH = frozenset(Endpoint)
_COMPLETIONS = frozenset({Endpoint.COMPLETIONS})
_CHAT = frozenset({Endpoint.CHAT})

# One row per accepted field: the endpoints that accept it and its check.
FIELDS: Mapping[str, tuple[frozenset[Endpoint], _Check]] = {
    "model": (_BOTH, _string),
    "prompt": (_COMPLETIONS, _prompt),
    "messages": (_CHAT, _messages),
    "max_tokens": (_BOTH, _integer(1, MAX_TOKENS_BOUND)),
    "max_completion_tokens": (_BOTH, _integer(1, MAX_TOKENS_BOUND)),
    "temperature": (_BOTH, _number(0, 2)),
    "top_p": (_BOTH, _number(0, 1)),
    "seed": (_BOTH, _seed),
    "stop": (_BOTH, _stop),
    "stream": (_BOTH, _boolean),
    "stream_options": (_BOTH, _stream_options),
    "presence_penalty": (_BOTH, _penalty),
    "frequency_penalty": (_BOTH, _penalty),
    "n": (_BOTH, _neutral(lambda v: _is_int(v) and v == 1, "1")),
    # extensions (llama-server / vLLM names)
    "top_k": (_BOTH, _top_k),
    "min_p": (_BOTH, _number(0, 1)),
    # Carried as a float32 (docs/PROTOCOL.md §2.2): bounded so it neither overflows nor rounds to 0.
    "repeat_penalty": (_BOTH, _number(REPEAT_PENALTY_RANGE[0], REPEAT_PENALTY_RANGE[1])),
    "ignore_eos": (_BOTH, _boolean),
    # OpenAI fields accepted at their neutral value only
    "user": (_BOTH, _string),
    "metadata": (_BOTH, _neutral(lambda v: isinstance(v, dict), "an object")),
    "store": (_BOTH, _neutral(lambda v: v is False, "false")),
    "service_tier": (_BOTH, _neutral(lambda v: v in ("auto", "default"), '"auto" or "default"')),
    "logprobs": (_BOTH, _neutral(lambda v: v is False, "false")),
    "logit_bias": (_BOTH, _neutral(lambda v: v == {}, "{}")),
    "echo": (_COMPLETIONS, _neutral(lambda v: v is False, "false")),
    "suffix": (_COMPLETIONS, _neutral(lambda v: v == "", '""')),
    "best_of": (_COMPLETIONS, _neutral(lambda v: _is_int(v) and v == 1, "1")),
    "top_logprobs": (_CHAT, _neutral(lambda v: _is_int(v) and v == 0, "0")),
    "response_format": (_CHAT, _neutral(lambda v: v == {"type": "text"}, '{"type": "text"}')),
    "tools": (_CHAT, _neutral(lambda v: v == [], "[]")),
    "functions": (_CHAT, _neutral(lambda v: v == [], "[]")),
    "tool_choice": (_CHAT, _neutral(lambda v: v in ("none", "auto"), '"none" or "auto" (no tools)')),
    "function_call": (_CHAT, _neutral(lambda v: v in ("none", "auto"), '"none" or "auto" (no functions)')),
    "parallel_tool_calls": (_CHAT, _boolean),
    "modalities": (_CHAT, _neutral(lambda v: v == ["text"], '["text"]')),
}


def _parse_fields(endpoint: Endpoint, body: Any) -> dict[str, Any]:
    """Every non-null field of `body`, checked; unknown fields are refused."""
    if not isinstance(body, dict):
        raise ApiError.invalid(None, "the request body must be a JSON object")
    parsed: dict[str, Any] = {}
    for name, value in body.items():
        row = FIELDS.get(name)
        if row is None or endpoint not in row[0]:
            route = "/v1/completions" if endpoint is Endpoint.COMPLETIONS else "/v1/chat/completions"
            raise ApiError.invalid(shown(name), f"unknown field {_shown(name)}: {route} does not accept it")
        if value is not None:
            parsed[name] = row[1](value, name)
    return parsed


# --- the request ------------------------------------------------------------------------------


@attrs.frozen
class CompletionParams:
    """A validated completion or chat request (None: the field was absent or null)."""

    endpoint: Endpoint
    model: str | None = None
    prompt: str | tuple[int, ...] = ""
    messages: tuple[Mapping[str, Any], ...] = ()
    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    logprobs: int | None = None  # alternatives per token; None: no logprobs (chat: top_logprobs)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_json(cls, endpoint: Endpoint, data: bytes) -> CompletionParams:
        """Validate a request body as received: ApiError 400 when it is not UTF-8 JSON or holds text
        that is not valid Unicode (naming the field), else as `from_body`."""
        try:
            body = RequestJson.parse(data, "request body").checked()
        except RequestJsonError as exc:
            raise ApiError.from_exception(exc) from None
        return cls.from_body(endpoint, body)

    @classmethod
    def from_body(cls, endpoint: Endpoint, body: Any) -> CompletionParams:
        """Validate a request body (the parsed JSON); ApiError 400 naming the first bad field."""
        fields = _parse_fields(endpoint, body)
        required = "prompt" if endpoint is Endpoint.COMPLETIONS else "messages"
        if required not in fields:
            raise ApiError.invalid(required, f"{required} is required")
        if "stream_options" in fields and not fields.get("stream"):
            raise ApiError.invalid("stream_options", "stream_options is only accepted with stream: true")
        max_field = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
        if fields.get("max_tokens", fields.get(max_field)) != fields.get(max_field):
            raise ApiError.invalid(max_field, "max_tokens and max_completion_tokens disagree; give one of them")
        return cls(
            endpoint=endpoint,
            model=fields.get("model"),
            prompt=fields.get("prompt", ""),
            messages=fields.get("messages", ()),
            max_tokens=fields.get(max_field),
            max_tokens_field=max_field,
            temperature=fields.get("temperature", 1.0),
            top_p=fields.get("top_p", 1.0),
            top_k=fields.get("top_k", 0),
            min_p=fields.get("min_p", 0.0),
            repeat_penalty=fields.get("repeat_penalty", 1.0),
            seed=fields.get("seed"),
            ignore_eos=fields.get("ignore_eos", False),
            stop=fields.get("stop", ()),
            stream=fields.get("stream", False),
            include_usage=fields.get("stream_options", False),
        )

    def check_model(self, served: str) -> None:
        """404 unless the request omits `model` or names the served model."""
        if self.model is not None and self.model != served:
            raise ApiError.model_not_found(self.model, served)

    def sampling(self, random_seed: Callable[[], int] = lambda: secrets.randbits(64)) -> SamplingParams:
        """The sampler settings; without `seed`, a fresh random one. top_p 0 keeps only the
        most likely token, which is greedy."""
        greedy = self.temperature == 0 or self.top_p == 0
        return SamplingParams(
            temperature=0.0 if greedy else self.temperature,
            top_k=self.top_k,
            top_p=1.0 if greedy else self.top_p,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            seed=self.seed if self.seed is not None else random_seed(),
            ignore_eos=self.ignore_eos,
        )

    def generation_request(
        self,
        prompt_ids: Sequence[int],
        ctx_size: int,
        *,
        n_vocab: int,
        prompt_text: str = "",
        random_seed: Callable[[], int] = lambda: secrets.randbits(64),
    ) -> GenerationRequest:
        """The engine request for the tokenized prompt, after the context checks (400s)."""
        param = "prompt" if self.endpoint is Endpoint.COMPLETIONS else "messages"
        if not prompt_ids:
            raise ApiError.invalid(param, f"{param} gives no tokens")
        bad = next((token for token in prompt_ids if not 0 <= token < n_vocab), None)
        if bad is not None:
            raise ApiError.invalid(param, f"{param} holds token id {bad}; the vocabulary has ids 0..{n_vocab - 1}")
        count = len(prompt_ids)
        room = ctx_size - count
        if room < 1:
            raise ApiError.context_length(
                param, f"the context holds {ctx_size} tokens and the {param} has {count}, leaving no room to generate"
            )
        if self.max_tokens is not None and self.max_tokens > room:
            raise ApiError.context_length(
                self.max_tokens_field,
                f"the context holds {ctx_size} tokens; the {param} has {count}, so {self.max_tokens_field} "
                f"may be at most {room}, got {self.max_tokens}",
            )
        default = COMPLETION_DEFAULT_MAX_TOKENS if self.endpoint is Endpoint.COMPLETIONS else room
        return GenerationRequest(
            prompt=prompt_text,
            max_tokens=self.max_tokens if self.max_tokens is not None else min(default, room),
            sampling=self.sampling(random_seed),
            stop=self.stop,
            prompt_ids=tuple(prompt_ids),
        )


# --- responses --------------------------------------------------------------------------------


def finish_reason(reason: str) -> str:
    """OpenAI's finish_reason for a session's: an end-of-generation token is a "stop"."""
    return "length" if reason == "length" else "stop"


@attrs.frozen
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int

    @classmethod
    def of(cls, result: GenerationResult) -> Usage:
        """The usage of a finished result (an emitted end-of-generation token counts)."""
        return cls(len(result.prompt_ids), len(result.tokens))

    def as_dict(self) -> JsonObject:
        """OpenAI's `usage` object."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


@attrs.frozen
class ResponseShape:
    """Builds one request's response object or stream chunks (same id and created time)."""

    endpoint: Endpoint
    id: str
    created: int
    model: str
    include_usage: bool = False

    @classmethod
    def new(cls, endpoint: Endpoint, model: str, *, include_usage: bool = False) -> ResponseShape:
        """A fresh id (`cmpl-...` or `chatcmpl-...`) created now."""
        return cls(endpoint, endpoint.id_prefix + secrets.token_hex(12), int(time.time()), model, include_usage)

    def _head(self, object_name: str) -> JsonObject:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def response(self, text: str, reason: str, usage: Usage) -> JsonObject:
        """The whole (non-streamed) response; `reason` is the session's finish reason."""
        choice: JsonObject = {"index": 0}
        if self.endpoint is Endpoint.COMPLETIONS:
            choice["text"] = text
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choice |= {"logprobs": None, "finish_reason": finish_reason(reason)}
        return self._head(self.endpoint.object_name) | {"choices": [choice], "usage": usage.as_dict()}

    def _chunk(self, content: JsonObject, reason: str | None) -> JsonObject:
        choice: JsonObject = {"index": 0}
        if self.endpoint is Endpoint.COMPLETIONS:
            choice["text"] = content.get("content", "")
        else:
            choice["delta"] = content
        choice |= {"logprobs": None, "finish_reason": reason}
        chunk = self._head(self.endpoint.chunk_object_name) | {"choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunk(self) -> JsonObject | None:
        """Chat streams open with the assistant role; completion streams have no opening chunk."""
        if self.endpoint is Endpoint.COMPLETIONS:
            return None
        return self._chunk({"role": "assistant", "content": ""}, None)

    def text_chunk(self, text: str) -> JsonObject:
        """A chunk carrying new text."""
        return self._chunk({"content": text}, None)

    def final_chunk(self, reason: str) -> JsonObject:
        """The chunk carrying the finish reason (no text)."""
        return self._chunk({}, finish_reason(reason))

    def usage_chunk(self, usage: Usage) -> JsonObject:
        """With `stream_options.include_usage`: the last chunk, empty choices and the usage."""
        return self._head(self.endpoint.chunk_object_name) | {"choices": [], "usage": usage.as_dict()}


def sse(payload: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.encode("utf-8", "backslashreplace") + b"\n\n"  # a lone surrogate as its JSON escape


SSE_DONE = b"data: [DONE]\n\n"
"""The event that ends every OpenAI stream."""
