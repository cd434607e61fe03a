"""OpenAI-compatible request bodies, responses, stream chunks and errors; socket-free.

`CompletionParams.from_body` validates the JSON body of `POST /v1/completions` or
`POST /v1/chat/completions` into one frozen value; `CompletionParams.generation_request` checks
the tokenized prompt against the context and builds the engine's `GenerationRequest`;
`ResponseShape` builds the response objects and the server-sent-event chunks in OpenAI's
shapes; `ApiError` is an OpenAI error object with its HTTP status. The HTTP gateway and the
ZeroMQ request API share all of it, so both validate a request the same way.

Choices where OpenAI-compatible servers differ:
- An unknown field is a 400 naming it (as OpenAI does; vLLM ignores unknown fields).
- OpenAI fields whose being ignored would change what the client gets (`echo`, `suffix`, `tools`,
  ...) are accepted only at their neutral value and are a 400 naming the field otherwise.
- `response_format` (and llama-server's `json_schema`, `grammar`, and `regex`) constrain the text
  at the final stage; the constraint is checked here first, so a schema or grammar that is not
  valid, or uses what the decoder cannot enforce, is a 400 naming where (docs/PROTOCOL.md §9.2).
- Fields OpenAI, llama-server or vLLM define that change nothing in the answer (`user`,
  `metadata`, `store`, `cache_prompt`, ...: `IGNORED_FIELDS`) are type-checked, then ignored, with
  one WARNING line per field name per process on the `skippy_zmq.gateway` logger (serve's log shows
  the package's records from WARNING up, so the operator sees it; docs/PROTOCOL.md §9.2).
  `null` is the same as leaving a field out.
- `prompt_tokens + max_tokens` must fit the context, else 400 `context_length_exceeded` (as
  vLLM; llama-server clamps instead). Without `max_tokens`, chat generates up to the context
  and completions 16 tokens, clamped to the room the prompt leaves.
- One prompt per request: a list of several prompts is a 400.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import math
import re
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeAlias

import attrs

from skippy_zmq.driver.generation import GenerationRequest, GenerationResult
from skippy_zmq.errors import (
    ConfigError,
    EngineUnavailable,
    QueueFull,
    RequestCancelled,
    RequestError,
    RequestJsonError,
    RequestTimeout,
    SkippyError,
    StageTimeout,
)
from skippy_zmq.gateway.reasoning import DEFAULT_THINKING, REASONING, ReasoningReader, Thinking
from skippy_zmq.gateway.request_json import OversizedInteger, RequestJson, shown
from skippy_zmq.gateway.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from skippy_zmq.gateway.tool_calls import ParsedAnswer, ToolCall, Tools
from skippy_zmq.gateway.tool_formats import ToolCallStream, ToolFormat, parse_tool_calls
from skippy_zmq.tokens.constraint import CONSTRAINT_KINDS, Constraint, ConstraintError, ConstraintKind
from skippy_zmq.tokens.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from skippy_zmq.tokens.sampling import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, PENALTY_RANGE, SamplingParams
from skippy_zmq.tokens.tokenizer import Tokenizer
from skippy_zmq.wire.messages import MAX_DRAFT_TOKENS

MAX_STOP_STRINGS = 4
"""Stop strings per request, OpenAI's limit."""
MAX_BATCH_PROMPTS = 64
"""Prompts one /v1/completions request may batch (each is a request on the engine; docs/PROTOCOL.md §9.2)."""
MAX_CHOICES = 128
"""Most choices one request may ask for, OpenAI's limit of `n` (the pipeline's lanes bound it further)."""
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
MAX_COMPLETION_LOGPROBS = 5
"""Largest `logprobs` of /v1/completions (OpenAI's limit; chat's `top_logprobs` goes to 20)."""
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")  # a logit_bias key: a decimal token id, ASCII digits only

_log = logging.getLogger("skippy_zmq.gateway")

JsonObject: TypeAlias = dict[str, Any]
SseEvent: TypeAlias = tuple[str, JsonObject]
"""One named server-sent event (Anthropic's and the Responses API's streams): its name and its data."""


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
        details: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = kind  # OpenAI's `type` field
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.details = dict(details or {})  # llama-server's extra fields of the error object

    def body(self) -> JsonObject:
        """The JSON object of the response body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.details}}

    @classmethod
    def invalid(cls, param: str | None, message: str, code: str | None = None) -> ApiError:
        """400: the request is malformed; `param` names the field."""
        return cls(400, message, param=param, code=code)

    @classmethod
    def too_large(cls, message: str) -> ApiError:
        """413 `request_too_large`: the body is above the gateway's limit."""
        return cls(413, message, code="request_too_large")

    @classmethod
    def context_length(cls, param: str, message: str, *, n_prompt_tokens: int, n_ctx: int) -> ApiError:
        """400 `context_length_exceeded`: the prompt (plus the requested tokens) does not fit. The type and the
        `n_prompt_tokens`/`n_ctx` fields are llama-server's (clients read them to trim); the code is OpenAI's."""
        return cls(400, message, kind="exceed_context_size_error", param=param, code="context_length_exceeded",
                   details={"n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx})

    @classmethod
    def model_not_found(cls, model: str, served: str) -> ApiError:
        """404 `model_not_found`: the request names a model this server does not serve."""
        return cls(404, f"model {shown_value(model)} does not exist here; this server serves {served!r}",
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
        """401 `authentication_error` (llama-server's type): the API key is missing or wrong (OpenAI's code
        `invalid_api_key` for a wrong key)."""
        if key_given:
            return cls(401, "Incorrect API key provided.", kind="authentication_error", code="invalid_api_key")
        return cls(401, "You didn't provide an API key: send it in an Authorization header using Bearer auth "
                   "(Authorization: Bearer YOUR_KEY) or as X-Api-Key: YOUR_KEY.", kind="authentication_error")

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

FieldCheck: TypeAlias = Callable[[Any, str], Any]
"""(value, field name) -> parsed value; raises ApiError naming the field."""


def shown_value(value: object) -> str:
    """A client's value in an error message: its repr (lone surrogates escaped), cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def is_int(value: object) -> bool:
    """Whether a JSON value is an integer (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """Whether a JSON value is a finite number (a bool is not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer_field(low: int, high: int | None = None) -> FieldCheck:
    """The check of an integer field in [low, high] (no upper bound when `high` is None)."""

    def check(value: Any, name: str) -> int:
        if not is_int(value) or value < low or (high is not None and value > high):
            upper = "" if high is None else f" and <= {high}"
            raise ApiError.invalid(name, f"{name} must be an integer >= {low}{upper}, got {shown_value(value)}")
        return int(value)

    return check


def number_field(low: float, high: float, *, low_open: bool = False) -> FieldCheck:
    """The check of a finite number field in [low, high] (or (low, high] with `low_open`)."""

    def check(value: Any, name: str) -> float:
        if not is_number(value) or value > high or value < low or (low_open and value == low):
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise ApiError.invalid(name, f"{name} must be a number in {interval}, got {shown_value(value)}")
        return float(value)

    return check


def boolean_field(value: Any, name: str) -> bool:
    """The check of a true/false field."""
    if not isinstance(value, bool):
        raise ApiError.invalid(name, f"{name} must be true or false, got {shown_value(value)}")
    return value


def string_field(value: Any, name: str) -> str:
    """The check of a string field."""
    if not isinstance(value, str):
        raise ApiError.invalid(name, f"{name} must be a string, got {shown_value(value)}")
    return value


def _neutral(accepts: Callable[[Any], bool], neutral: str) -> FieldCheck:
    """A field skippy-zmq does not implement: only its neutral value (or null) is accepted."""

    def check(value: Any, name: str) -> Any:
        if not accepts(value):
            raise ApiError.invalid(
                name, f"{name} {json.dumps(value, default=repr)[:_SHOWN_CHARS]} is not supported; only {neutral} "
                "(or null) is accepted"
            )
        return value

    return check


def _logit_bias(value: Any, name: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` object as (id, bias) pairs sorted by id; ids are checked
    against the vocabulary later, where n_vocab is known (`generation_request`)."""
    if not isinstance(value, dict):
        raise ApiError.invalid(name, f"{name} must be an object mapping token ids (as strings) to biases, "
                               f"got {shown_value(value)}")
    if len(value) > MAX_LOGIT_BIAS:
        raise ApiError.invalid(name, f"{name} has {len(value)} entries; at most {MAX_LOGIT_BIAS} are accepted")
    low, high = LOGIT_BIAS_RANGE
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        if not isinstance(key, str) or not _TOKEN_ID_KEY.fullmatch(key) or int(key) > _MAX_TOKEN_ID:
            raise ApiError.invalid(name, f"{name} key {shown_value(key)} is not a token id; keys are decimal token ids "
                                   f"in [0, {_MAX_TOKEN_ID}], such as \"50256\"")
        if not is_number(bias) or not low <= bias <= high:
            raise ApiError.invalid(name, f"{name}[{key!r}] must be a number in [{low:g}, {high:g}], got "
                                   f"{shown_value(bias)}")
        if int(key) in pairs:
            raise ApiError.invalid(name, f"{name} key {shown_value(key)} names token {int(key)} a second time")
        pairs[int(key)] = float(bias)
    return tuple(sorted(pairs.items()))


def _logprobs(value: Any, name: str) -> bool | int:
    """Completions: an integer 0..5; chat: a boolean (`from_body` tells them apart)."""
    if isinstance(value, bool) or (is_int(value) and 0 <= value <= MAX_COMPLETION_LOGPROBS):
        return value  # type: ignore[no-any-return]
    raise ApiError.invalid(name, f"{name} must be an integer in [0, {MAX_COMPLETION_LOGPROBS}] (completions) or "
                           f"true/false (chat), got {shown_value(value)}")


def object_field(value: Any, name: str) -> Any:
    """A field that must be a JSON object, as it is; 400 naming it otherwise."""
    if not isinstance(value, dict):
        raise ApiError.invalid(name, f"{name} must be an object, got {shown_value(value)}")
    return value


def list_field(value: Any, name: str) -> list[Any]:
    """A field that must be a JSON array, as it is; 400 naming it otherwise."""
    if not isinstance(value, list):
        raise ApiError.invalid(name, f"{name} must be a list, got {shown_value(value)}")
    return value


def _seed(value: Any, name: str) -> int:
    if not is_int(value) or not -(2**63) <= value <= _SEED_MASK:
        raise ApiError.invalid(name, f"{name} must be an integer in [-2**63, 2**64), got {shown_value(value)}")
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
            boolean_field(item, f"{name}.{key}")
    return bool(value.get("include_usage"))


@functools.lru_cache(maxsize=256)
def _checked(kind: ConstraintKind, text: str) -> tuple[Constraint | None, str]:
    """A constraint checked once per distinct text (a repeated schema is not checked again):
    (the constraint, "") or (None, what is wrong)."""
    try:
        constraint = Constraint(kind, text)
        constraint.check()
    except ConstraintError as exc:  # the field's name says which language: not again in its message
        return None, str(exc).removeprefix("constraint: ").removeprefix(f"{CONSTRAINT_KINDS[kind].name}: ")
    return constraint, ""


def constraint_field(kind: ConstraintKind, text: str, name: str) -> Constraint:
    """The checked constraint of field `name`; ApiError 400 naming the field and where it fails."""
    constraint, error = _checked(kind, text)
    if constraint is None:
        raise ApiError.invalid(name, f"{name}: {error}", code="invalid_constraint")
    return constraint


def _schema_text(value: Any, name: str) -> str:
    if not isinstance(value, (dict, bool)):
        raise ApiError.invalid(name, f"{name} must be a JSON schema (an object or a boolean), got {shown_value(value)}")
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def response_format_field(value: Any, name: str) -> Constraint | None:
    """OpenAI's `response_format` (text, json_object, json_schema with name, schema and strict; a
    json_object with llama-server's `schema`) as a constraint, None for text."""
    object_field(value, name)
    kind = value.get("type")
    if kind == "text" and len(value) == 1:
        return None
    if kind == "json_object":
        unknown = sorted(set(value) - {"type", "schema"})
        if unknown:
            raise ApiError.invalid(f"{name}.{shown(unknown[0])}", f"unknown field {name}.{shown(unknown[0])}")
        if "schema" in value:
            return constraint_field(ConstraintKind.JSON_SCHEMA, _schema_text(value["schema"], f"{name}.schema"),
                                    f"{name}.schema")
        return constraint_field(ConstraintKind.JSON_OBJECT, "", name)
    if kind == "json_schema":
        spec = object_field(value.get("json_schema"), f"{name}.json_schema")
        for key, item in spec.items():
            if key not in ("name", "schema", "strict", "description"):
                raise ApiError.invalid(f"{name}.json_schema.{shown(key)}",
                                       f"unknown field {name}.json_schema.{shown(key)}")
            if key in ("name", "description") and not isinstance(item, str):
                raise ApiError.invalid(f"{name}.json_schema.{key}", f"{name}.json_schema.{key} must be a string")
            if key == "strict" and item is not None:
                boolean_field(item, f"{name}.json_schema.strict")
        # `strict` or not, the schema is enforced as written: the decoder never drops a keyword.
        schema = spec.get("schema", {})
        return constraint_field(ConstraintKind.JSON_SCHEMA, _schema_text(schema, f"{name}.json_schema.schema"),
                                f"{name}.json_schema.schema")
    raise ApiError.invalid(f"{name}.type", f"{name}.type must be \"text\", \"json_object\" or \"json_schema\", "
                           f"got {shown_value(kind)}")


def grammar_field(value: Any, name: str) -> Constraint:
    """llama-server's `grammar`: GBNF, or Lark in llguidance's dialect when it starts `%llguidance`."""
    text = string_field(value, name)
    lark = text.lstrip().startswith("%llguidance")
    return constraint_field(ConstraintKind.LARK if lark else ConstraintKind.GBNF, text, name)


def json_schema_field(value: Any, name: str) -> Constraint:
    """llama-server's `json_schema`: the schema itself."""
    return constraint_field(ConstraintKind.JSON_SCHEMA, _schema_text(value, name), name)


def regex_field(value: Any, name: str) -> Constraint:
    """A regular expression the whole text must match (Rust's `regex` syntax)."""
    return constraint_field(ConstraintKind.REGEX, string_field(value, name), name)


CONSTRAINT_FIELDS = ("response_format", "json_schema", "grammar", "regex")
"""The fields that constrain the text; a request gives at most one."""


def constraint_of(fields: Mapping[str, Any]) -> Constraint | None:
    """The one constraint among the parsed fields, if any; ApiError 400 when several are given."""
    given = [name for name in CONSTRAINT_FIELDS if fields.get(name) is not None]
    if len(given) > 1:
        raise ApiError.invalid(given[1], f"{given[0]} and {given[1]} both constrain the text; give one of them")
    return fields[given[0]] if given else None


def tool_list_field(value: Any, name: str) -> Any:
    """`tools`: a list (its tools are checked with `tool_choice` by `tools_of`)."""
    if not isinstance(value, list):
        raise ApiError.invalid(name, f"{name} must be a list of tool objects, got {shown_value(value)}")
    return value


def tool_choice_field(value: Any, name: str) -> Any:
    """`tool_choice`: a string or an object (checked against the tools by `tools_of`)."""
    if not isinstance(value, (str, dict)):
        raise ApiError.invalid(name, f"{name} must be \"none\", \"auto\", \"required\" or a named function, "
                               f"got {shown_value(value)}")
    return value


def tools_of(fields: Mapping[str, Any]) -> Tools | None:
    """The request's tools (None without any, or with an empty list): `tools`, `tool_choice` and
    `parallel_tool_calls` checked together; ApiError 400 naming the field at fault."""
    tools = fields.get("tools") or []
    choice = fields.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError.invalid("tool_choice", f"tool_choice {shown_value(choice)} needs tools; none were given")
        return None
    try:
        return Tools.from_request(tools, choice, fields.get("parallel_tool_calls"))
    except RequestError as exc:
        text = str(exc)
        return _raise(ApiError.invalid(text.split(":", 1)[0], text))


def _raise(error: ApiError) -> NoReturn:
    raise error


REPEAT_PENALTY_RANGE = (1e-6, 1e6)
"""Accepted repeat_penalty values: positive, and far inside float32's range."""


def _top_k(value: Any, name: str) -> int:
    # The stage link carries top_k as an int32 (docs/PROTOCOL.md §2.2).
    return 0 if value == -1 and is_int(value) else integer_field(0, 2**31 - 1)(value, name)


def _prompt(value: Any, name: str) -> str | tuple[int, ...]:
    """A string, a list of token ids, or a list holding exactly one of those."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise ApiError.invalid(name, f"{name} must be a string or a non-empty list of token ids")
    if all(is_int(item) or isinstance(item, OversizedInteger) for item in value):
        bad = [item for item in value if not is_int(item) or not 0 <= item <= _MAX_TOKEN_ID]
        if bad:
            raise ApiError.invalid(name, f"{name} holds token id {shown_value(bad[0])}; token ids are integers in "
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
    if len(value) >= 2 and all(message.get("role") == "assistant" for message in value[-2:]):
        # a last assistant message is a start the answer continues: two of them have no one reading (llama-server)
        raise ApiError.invalid(name, f"{name} cannot end with 2 or more assistant messages; join them into one")
    return tuple(value)


def continue_final_field(value: Any, name: str) -> bool:
    """llama-server's continue_final_message: true or "content" continue the last message, false or
    another text do not; "reasoning_content" (continuing a reasoning part) is refused."""
    if isinstance(value, str) and value == "reasoning_content":
        raise ApiError.invalid(name, f'{name} "reasoning_content" is not supported: the answer may continue the '
                               'last message\'s content only (true or "content")')
    if not isinstance(value, (bool, str)):
        raise ApiError.invalid(name, f'{name} must be true, false or "content", got {shown_value(value)}')
    return value is True or value == "content"


def chat_continuation(fields: Mapping[str, Any]) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final) of a chat body, llama-server's rules: a last assistant
    message is continued unless the body says otherwise; continuing it and adding a generation prompt
    both are refused; only an assistant's message without tool calls is continued."""
    messages = fields.get("messages", ())
    last = messages[-1] if messages else {}
    continuing = fields.get("continue_final_message", False)
    generation = fields.get("add_generation_prompt", True)
    if "continue_final_message" not in fields and last.get("role") == "assistant":
        continuing, generation = True, False  # llama-server's assistant prefill
    if continuing and generation:
        raise ApiError.invalid("continue_final_message", "continue_final_message and add_generation_prompt cannot "
                               "both be true: give add_generation_prompt: false to continue the last message")
    if continuing and last.get("role") != "assistant":
        raise ApiError.invalid("continue_final_message", f"continue_final_message needs the last message to be the "
                               f"assistant's, not {shown_value(last.get('role'))}'s")
    if continuing and last.get("tool_calls"):
        raise ApiError.invalid("continue_final_message", "continue_final_message cannot continue an assistant "
                               "message that holds tool_calls")
    return generation, continuing


_BOTH = frozenset(Endpoint)
_COMPLETIONS = frozenset({Endpoint.COMPLETIONS})
_CHAT = frozenset({Endpoint.CHAT})

# One row per accepted field: the endpoints that accept it and its check.
FIELDS: Mapping[str, tuple[frozenset[Endpoint], FieldCheck]] = {
    "model": (_BOTH, string_field),
    "prompt": (_COMPLETIONS, _prompt),
    "messages": (_CHAT, _messages),
    "max_tokens": (_BOTH, integer_field(1, MAX_TOKENS_BOUND)),
    "max_completion_tokens": (_BOTH, integer_field(1, MAX_TOKENS_BOUND)),
    # llama-server's: -1 or more than fits runs up to the context (max_tokens and its kin win over it)
    "n_predict": (_BOTH, integer_field(-1, MAX_TOKENS_BOUND)),
    "temperature": (_BOTH, number_field(0, 2)),
    "top_p": (_BOTH, number_field(0, 1)),
    "seed": (_BOTH, _seed),
    "stop": (_BOTH, _stop),
    "stream": (_BOTH, boolean_field),
    "stream_options": (_BOTH, _stream_options),
    "presence_penalty": (_BOTH, number_field(*PENALTY_RANGE)),
    "frequency_penalty": (_BOTH, number_field(*PENALTY_RANGE)),
    "logit_bias": (_BOTH, _logit_bias),
    "n": (_BOTH, integer_field(1, MAX_CHOICES)),
    "best_of": (_COMPLETIONS, integer_field(1, MAX_CHOICES)),
    "logprobs": (_BOTH, _logprobs),
    "top_logprobs": (_CHAT, integer_field(0, MAX_TOP_LOGPROBS)),
    "post_sampling_probs": (_CHAT, boolean_field),  # llama-server's: the logprobs after the sampler's filters
    # extensions (llama-server / vLLM names)
    "top_k": (_BOTH, _top_k),
    "min_p": (_BOTH, number_field(0, 1)),
    # Carried as a float32 (docs/PROTOCOL.md §2.2): bounded so it neither overflows nor rounds to 0.
    "repeat_penalty": (_BOTH, number_field(REPEAT_PENALTY_RANGE[0], REPEAT_PENALTY_RANGE[1])),
    "ignore_eos": (_BOTH, boolean_field),
    "cache_prompt": (_BOTH, boolean_field),  # llama-server's: false opts out of the prompt cache
    "response_format": (_BOTH, response_format_field),
    "json_schema": (_BOTH, json_schema_field),  # llama-server's
    "grammar": (_BOTH, grammar_field),  # llama-server's: GBNF (or `%llguidance` Lark)
    "regex": (_BOTH, regex_field),
    # a chat's thought (llama-server's; reasoning.py): template arguments, where the thought goes, effort
    "chat_template_kwargs": (_CHAT, object_field),
    "reasoning_format": (_CHAT, string_field),
    "reasoning_effort": (_CHAT, string_field),
    # accepted and ignored (IGNORED_FIELDS): nothing in the answer depends on them
    "user": (_BOTH, string_field),
    "safety_identifier": (_BOTH, string_field),
    "prompt_cache_key": (_BOTH, string_field),
    "prompt_cache_retention": (_BOTH, string_field),
    "metadata": (_BOTH, object_field),
    "store": (_BOTH, boolean_field),
    "service_tier": (_BOTH, string_field),
    # llama-server's: a stream's chunks carry `timings`, and its prompt's progress (PROTOCOL §9.6)
    "timings_per_token": (_BOTH, boolean_field),
    "return_progress": (_BOTH, boolean_field),
    # llama-server's: most drafts a decode step carries (PROTOCOL §6, Speculative decoding); n_min and p_min
    # (a draft model's thresholds) are type-checked and ignored: n-gram drafts are sized by what was accepted
    "speculative.n_max": (_BOTH, integer_field(0, MAX_DRAFT_TOKENS)),
    "speculative.n_min": (_BOTH, integer_field(0, MAX_DRAFT_TOKENS)),
    "speculative.p_min": (_BOTH, number_field(0, 1)),
    "id_slot": (_BOTH, integer_field(-1, 2**31 - 1)),  # llama-server's slot choice: the scheduler picks lanes
    "verbose": (_BOTH, boolean_field),  # llama-server's: the answer's `__verbose` (PROTOCOL §9.6)
    "add_generation_prompt": (_CHAT, boolean_field),  # llama-server's, as continue_final_message
    "continue_final_message": (_CHAT, continue_final_field),
    "parallel_tool_calls": (_CHAT, boolean_field),
    "tools": (_CHAT, tool_list_field),
    "tool_choice": (_CHAT, tool_choice_field),
    "prediction": (_CHAT, object_field),
    # OpenAI fields accepted at their neutral value only: ignoring another value would change the answer
    "echo": (_COMPLETIONS, _neutral(lambda v: v is False, "false")),
    "suffix": (_COMPLETIONS, _neutral(lambda v: v == "", '""')),
    "functions": (_CHAT, _neutral(lambda v: v == [], "[]")),
    "function_call": (_CHAT, _neutral(lambda v: v in ("none", "auto"), '"none" or "auto" (no functions)')),
    "modalities": (_CHAT, _neutral(lambda v: v == ["text"], '["text"]')),
}


IGNORED_FIELDS = frozenset({
    "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "metadata", "store", "service_tier",
    "prediction", "id_slot", "speculative.n_min", "speculative.p_min",
})
"""Fields other servers define that this one accepts (type-checked) and does not act on: an end
user's id, storage and routing hints, llama-server's slot choice, a predicted output (a latency hint;
the answer is the same without it)."""


class IgnoredFieldLog:
    """One WARNING line per ignored field name per process (thread-safe: both front ends parse)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def note(self, name: str) -> None:
        """Log `name` the first time a request carries it."""
        with self._lock:
            if name in self._seen:
                return
            self._seen.add(name)
        _log.warning("a request carries %r, which this server accepts and ignores (docs/PROTOCOL.md §9.2); "
                     "this is said once per field", name)


IGNORED_LOG = IgnoredFieldLog()
"""The process's record of the ignored fields already logged."""


def _parse_fields(endpoint: Endpoint, body: Any) -> dict[str, Any]:
    """Every non-null field of `body`, checked; unknown fields are refused."""
    if not isinstance(body, dict):
        raise ApiError.invalid(None, "the request body must be a JSON object")
    parsed: dict[str, Any] = {}
    for name, value in body.items():
        row = FIELDS.get(name)
        if row is None or endpoint not in row[0]:
            route = "/v1/completions" if endpoint is Endpoint.COMPLETIONS else "/v1/chat/completions"
            raise ApiError.invalid(shown(name), f"unknown field {shown_value(name)}: {route} does not accept it")
        if value is not None:
            parsed[name] = row[1](value, name)
            if name in IGNORED_FIELDS:
                IGNORED_LOG.note(name)
    return parsed


def _requested_logprobs(endpoint: Endpoint, fields: Mapping[str, Any]) -> int | None:
    """Alternatives per token, or None for no logprobs: completions' `logprobs` k, chat's
    `logprobs: true` with `top_logprobs` k (0 when absent)."""
    asked = fields.get("logprobs")
    if endpoint is Endpoint.COMPLETIONS:
        if asked is True:
            raise ApiError.invalid("logprobs", f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}] on "
                                   "/v1/completions (the alternatives per token), got true")
        return None if asked is None or asked is False else int(asked)
    if asked is not None and not isinstance(asked, bool):
        raise ApiError.invalid("logprobs", f"logprobs must be true or false on /v1/chat/completions (give the "
                               f"alternatives in top_logprobs), got {shown_value(asked)}")
    top = fields.get("top_logprobs")
    if top is not None and asked is not True:
        raise ApiError.invalid("top_logprobs", f"top_logprobs {top} needs logprobs: true")
    return (top or 0) if asked else None


def thinking_of(fields: Mapping[str, Any], defaults: Thinking) -> Thinking:
    """A chat's thought settings: the server's, then the request's (400 naming the field at fault)."""
    effort = fields.get("reasoning_effort")
    if effort is not None and not effort:
        raise ApiError.invalid("reasoning_effort", "reasoning_effort must be a level such as \"low\" or \"high\", "
                               "or \"none\" to turn thought off; got \"\"")
    try:
        return Thinking.from_request(defaults, fields.get("chat_template_kwargs"), effort,
                                     fields.get("reasoning_format"))
    except ConfigError as exc:
        param = "reasoning_format" if str(exc).startswith("reasoning_format") else "chat_template_kwargs"
        raise ApiError.invalid(param, str(exc)) from None


def _choices(fields: Mapping[str, Any]) -> int:
    """`n`, with `best_of` (completions) only equal to it: every generated choice is returned."""
    n = int(fields.get("n", 1))
    best_of = fields.get("best_of")
    if best_of is not None and best_of != n:
        raise ApiError.invalid("best_of", f"best_of {best_of} differs from n {n}: this server returns every "
                               "choice it generates, so best_of may only be null or equal to n")
    return n


# --- the request ------------------------------------------------------------------------------


def checked_body(data: bytes) -> Any:
    """A request body as received, parsed: ApiError 400 when it is not UTF-8 JSON or holds text that is not
    valid Unicode (naming the field)."""
    try:
        return RequestJson.parse(data, "request body").checked()
    except RequestJsonError as exc:
        raise ApiError.from_exception(exc) from None


def known_fields(body: Any, known: frozenset[str], route: str) -> dict[str, Any]:
    """A body's non-null fields (`null` is absent), after the checks that it is an object and names no field
    outside `known`: ApiError 400 naming the field `route` does not accept."""
    if not isinstance(body, dict):
        raise ApiError.invalid(None, "the request body must be a JSON object")
    for name in body:
        if name not in known:
            raise ApiError.invalid(shown(name), f"unknown field {shown_value(name)}: {route} does not accept it")
    return {name: value for name, value in body.items() if value is not None}


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
    cache_prompt: bool = True  # llama-server's switch: false never continues a retained session (PROTOCOL §6)
    constraint: Constraint | None = None  # response_format, json_schema, grammar or regex (PROTOCOL §9.2)
    tools: Tools | None = None  # chat's tools, tool_choice and parallel_tool_calls (PROTOCOL §9.2, Tools)
    default_max_tokens: int | None = None  # without max_tokens (`serve -n`; None: 16 or up to the context)
    add_generation_prompt: bool = True  # chat: end the prompt with the template's generation prompt
    continue_final: bool = False  # chat: the answer continues the last (assistant) message
    verbose: bool | None = None  # llama-server's: the answer carries `__verbose` (None: as `serve -v` says)
    post_sampling_probs: bool = False  # chat, with logprobs: probabilities after the sampler's filters (§9.2)
    thinking: Thinking = DEFAULT_THINKING  # chat: thought on or off, where it goes (PROTOCOL §9.2, Reasoning)
    return_progress: bool = False  # llama-server's: a stream reports the prompt's progress (PROTOCOL §9.6)
    timings_per_token: bool = False  # llama-server's: every streamed chunk carries `timings` (PROTOCOL §9.6)
    draft_max: int | None = None  # llama-server's speculative.n_max (None: `serve --draft-max`; PROTOCOL §6)

    @classmethod
    def from_json(cls, endpoint: Endpoint, data: bytes, defaults: SamplingDefaults = NO_DEFAULTS) -> CompletionParams:
        """Validate a request body as received: ApiError 400 when it is not UTF-8 JSON or holds text
        that is not valid Unicode (naming the field), else as `from_body`."""
        return cls.from_body(endpoint, checked_body(data), defaults)

    @classmethod
    def from_body(cls, endpoint: Endpoint, body: Any, defaults: SamplingDefaults = NO_DEFAULTS) -> CompletionParams:
        """Validate a request body (the parsed JSON); ApiError 400 naming the first bad field. A sampling
        field left out takes the server's default (`defaults`), else OpenAI's."""
        fields = _parse_fields(endpoint, body)
        own = defaults.over(_OPENAI_SAMPLING)
        required = "prompt" if endpoint is Endpoint.COMPLETIONS else "messages"
        if required not in fields:
            raise ApiError.invalid(required, f"{required} is required")
        if "stream_options" in fields and not fields.get("stream"):
            raise ApiError.invalid("stream_options", "stream_options is only accepted with stream: true")
        max_field = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
        if fields.get("max_tokens", fields.get(max_field)) != fields.get(max_field):
            raise ApiError.invalid(max_field, "max_tokens and max_completion_tokens disagree; give one of them")
        if max_field not in fields and "n_predict" in fields:
            max_field = "n_predict"
            if fields[max_field] == 0:
                raise ApiError.invalid(max_field, "n_predict 0 would generate nothing; give at least 1, or -1 to "
                                       "run up to the context")
            fields[max_field] = None if fields[max_field] == -1 else fields[max_field]
        generation, continuing = chat_continuation(fields) if endpoint is Endpoint.CHAT else (True, False)
        return cls(
            endpoint=endpoint,
            model=fields.get("model"),
            prompt=fields.get("prompt", ""),
            messages=fields.get("messages", ()),
            max_tokens=fields.get(max_field),
            max_tokens_field=max_field,
            temperature=fields.get("temperature", max(own["temperature"], 0.0)),  # <= 0 is greedy in llama-server
            top_p=fields.get("top_p", own["top_p"]),
            top_k=fields.get("top_k", max(own["top_k"], 0)),
            min_p=fields.get("min_p", own["min_p"]),
            repeat_penalty=fields.get("repeat_penalty", 1.0),
            seed=fields.get("seed", own["seed"]),
            ignore_eos=fields.get("ignore_eos", False),
            stop=fields.get("stop", ()),
            stream=fields.get("stream", False),
            include_usage=fields.get("stream_options", False),
            n=_choices(fields),
            logprobs=_requested_logprobs(endpoint, fields),
            presence_penalty=fields.get("presence_penalty", 0.0),
            frequency_penalty=fields.get("frequency_penalty", 0.0),
            logit_bias=fields.get("logit_bias", ()),
            cache_prompt=fields.get("cache_prompt", True),
            constraint=constraint_of(fields),
            tools=tools_of(fields),
            default_max_tokens=defaults.max_tokens(),
            add_generation_prompt=generation,
            continue_final=continuing,
            verbose=fields.get("verbose"),
            post_sampling_probs=fields.get("post_sampling_probs", False),
            thinking=thinking_of(fields, defaults.thinking),
            return_progress=fields.get("return_progress", False),
            timings_per_token=fields.get("timings_per_token", False),
            draft_max=fields.get("speculative.n_max"),
        )

    @classmethod
    def batch_from_json(cls, endpoint: Endpoint, data: bytes,
                        defaults: SamplingDefaults = NO_DEFAULTS) -> tuple[CompletionParams, ...]:
        """Validate a body as received, as `batch_from_body`."""
        return cls.batch_from_body(endpoint, checked_body(data), defaults)

    @classmethod
    def batch_from_body(cls, endpoint: Endpoint, body: Any,
                        defaults: SamplingDefaults = NO_DEFAULTS) -> tuple[CompletionParams, ...]:
        """A body as one request (`from_body`), or on /v1/completions a `prompt` list of several prompts
        (texts or lists of ids, as OpenAI and llama-server take them) as one request each, with `n` 1."""
        prompts = body.get("prompt") if endpoint is Endpoint.COMPLETIONS and isinstance(body, dict) else None
        if not (isinstance(prompts, list) and len(prompts) > 1 and all(isinstance(p, (str, list)) for p in prompts)):
            return (cls.from_body(endpoint, body, defaults),)
        if len(prompts) > MAX_BATCH_PROMPTS:
            raise ApiError.invalid("prompt", f"prompt holds {len(prompts)} prompts; at most {MAX_BATCH_PROMPTS} are "
                                   "accepted in one request")
        batch = []
        for index, prompt in enumerate(prompts):
            try:
                batch.append(cls.from_body(endpoint, body | {"prompt": prompt}, defaults))
            except ApiError as error:
                if error.param != "prompt":
                    raise
                raise ApiError.invalid(f"prompt[{index}]", f"prompt[{index}]: {error.message}") from None
        if batch[0].n > 1:
            raise ApiError.invalid("n", f"n {batch[0].n} with {len(batch)} prompts: a batch of prompts takes n 1")
        return tuple(batch)

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
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
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
        biased = next((token for token, _ in reversed(self.logit_bias) if token >= n_vocab), None)
        if biased is not None:
            raise ApiError.invalid("logit_bias", f"logit_bias key \"{biased}\" is not in the vocabulary, which has "
                                   f"ids 0..{n_vocab - 1}")
        count = len(prompt_ids)
        room = ctx_size - count
        if room < 1:
            raise ApiError.context_length(
                param, f"the context holds {ctx_size} tokens and the {param} has {count}, leaving no room to generate",
                n_prompt_tokens=count, n_ctx=ctx_size)
        if self.max_tokens is not None and self.max_tokens > room:
            raise ApiError.context_length(
                self.max_tokens_field,
                f"the context holds {ctx_size} tokens; the {param} has {count}, so {self.max_tokens_field} "
                f"may be at most {room}, got {self.max_tokens}", n_prompt_tokens=count, n_ctx=ctx_size)
        default = COMPLETION_DEFAULT_MAX_TOKENS if self.endpoint is Endpoint.COMPLETIONS else room
        if self.default_max_tokens is not None:
            default = self.default_max_tokens
        return GenerationRequest(
            prompt=prompt_text,
            max_tokens=self.max_tokens if self.max_tokens is not None else min(default, room),
            sampling=self.sampling(random_seed),
            stop=self.stop,
            prompt_ids=tuple(prompt_ids),
            logprobs=self.logprobs,
            post_sampling_probs=self.post_sampling_probs and self.logprobs is not None,
            n=self.n,  # with a seed, choice i samples with seed + i (docs/PROTOCOL.md §9.2)
            cache_prompt=self.cache_prompt,
            constraint=self.constraint,
            progress=self.stream and self.return_progress,
            timings=self.stream and self.timings_per_token,
            draft_max=self.draft_max,
        )


_OPENAI_SAMPLING: Mapping[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None}
"""OpenAI's defaults of the sampling fields `serve --temp` and its kin may replace."""


# --- responses --------------------------------------------------------------------------------


def finish_reason(reason: str, *, called: bool = False) -> str:
    """OpenAI's finish_reason for a session's: an end-of-generation token is a "stop", or
    "tool_calls" when the answer `called` tools."""
    if reason == "length":
        return "length"
    return "tool_calls" if called else "stop"


@attrs.frozen
class ToolAnswers:
    """How a request with tools reads its answers: the template's call format and the request's tools."""

    format: ToolFormat
    tools: Tools

    def parse(self, text: str) -> ParsedAnswer:
        """A whole answer's content and calls (all content when a call does not parse)."""
        return parse_tool_calls(self.format, text, self.tools)

    def stream(self) -> ToolCallStream:
        """A reader of one choice's streamed answer."""
        return ToolCallStream(self.format, self.tools)


@attrs.frozen
class Usage:
    """Token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt positions a kept session held (docs/PROTOCOL.md §6, Prompt cache)

    @classmethod
    def of(cls, result: GenerationResult) -> Usage:
        """The usage of a finished result (an emitted end-of-generation token counts)."""
        return cls(len(result.prompt_ids), len(result.tokens), result.cached_tokens)

    @classmethod
    def of_all(cls, results: Sequence[GenerationResult]) -> Usage:
        """OpenAI's rule for n choices: the prompt once, the completion tokens of every choice summed."""
        return cls(len(results[0].prompt_ids), sum(len(result.tokens) for result in results), results[0].cached_tokens)

    @classmethod
    def of_batch(cls, results: Sequence[GenerationResult]) -> Usage:
        """A batch of prompts (one result each): every prompt's and every completion's tokens summed."""
        return cls(sum(len(result.prompt_ids) for result in results), sum(len(result.tokens) for result in results),
                   sum(result.cached_tokens for result in results))

    def as_dict(self) -> JsonObject:
        """OpenAI's `usage` object; `prompt_tokens_details.cached_tokens` when a kept session held some."""
        usage: JsonObject = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


PieceOf: TypeAlias = Callable[[int], bytes]
"""A token id -> the bytes its logprobs entry shows (`token_piece`)."""


def token_piece(tokenizer: Tokenizer) -> PieceOf:
    """The piece of each id as logprobs show it: the bytes it adds to the text, or for a control
    token that adds none (EOS, end of turn) its vocab text, so every entry names its token."""

    def piece(token: int) -> bytes:
        data = tokenizer.token_bytes(token)
        return data if data else tokenizer.token_text(token).encode("utf-8")

    return piece


def _id_piece(token: int) -> bytes:
    return f"<{token}>".encode()


def _text(data: bytes) -> str:
    # A piece that is part of a UTF-8 sequence shows U+FFFD; its `bytes` (chat) keep the exact bytes.
    return data.decode("utf-8", "replace")


def completion_logprobs(entries: Sequence[TokenLogprobs], piece: PieceOf, offset: int = 0) -> JsonObject:
    """/v1/completions' `logprobs` object; `text_offset` counts characters from `offset` on. Each
    `top_logprobs` entry holds the alternatives and the sampled token (OpenAI: up to k + 1)."""
    tokens: list[str] = []
    offsets: list[int] = []
    tops: list[dict[str, float]] = []
    for entry in entries:
        text = _text(piece(entry.token))
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top = {_text(piece(token)): logprob for token, logprob in entry.top}
        top.setdefault(text, entry.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [entry.logprob for entry in entries], "top_logprobs": tops,
            "text_offset": offsets}


def _chat_token(token: int, logprob: float, piece: PieceOf, post_sampling: bool = False) -> JsonObject:
    data = piece(token)
    value = {"prob": math.exp(logprob)} if post_sampling else {"logprob": logprob}
    return {"token": _text(data)} | value | {"bytes": list(data)}


def chat_logprobs(entries: Sequence[TokenLogprobs], piece: PieceOf, *, post_sampling: bool = False) -> JsonObject:
    """/v1/chat/completions' `logprobs` object: `content`, one entry per token with its `top_logprobs`; with
    `post_sampling`, llama-server's `prob` and `top_probs` (the probabilities after the sampler's filters)."""
    top = "top_probs" if post_sampling else "top_logprobs"
    content = [_chat_token(entry.token, entry.logprob, piece, post_sampling)
               | {top: [_chat_token(token, logprob, piece, post_sampling) for token, logprob in entry.top]}
               for entry in entries]
    return {"content": content, "refusal": None}


@attrs.frozen
class Choice:
    """One finished choice of a response."""

    index: int
    text: str
    reason: str  # the session's finish reason
    logprobs: tuple[TokenLogprobs, ...] | None = None  # None: the request did not ask
    calls: tuple[ToolCall, ...] = ()  # the tools the answer called (`text` is then the rest of it)
    reasoning: str | None = None  # the answer's thought (`text` is then the rest of it)

    @classmethod
    def of(cls, result: GenerationResult, *, logprobs: bool, tools: ToolAnswers | None = None,
           reasoning: ReasoningReader | None = None) -> Choice:
        """The choice a finished result is; with `reasoning`, its thought read apart; with `tools`, the rest
        read for calls (a cut-off answer's text stays text)."""
        thought, text = reasoning.split(result.text) if reasoning is not None else (None, result.text)
        parsed = tools.parse(text) if tools is not None and result.finish_reason != "length" else None
        text, calls = (parsed.content, parsed.calls) if parsed is not None else (text, ())
        return cls(result.choice, text, result.finish_reason, tuple(result.logprobs) if logprobs else None, calls,
                   thought)


@attrs.frozen
class ResponseShape:
    """Builds one request's response object or stream chunks (same id and created time)."""

    endpoint: Endpoint
    id: str
    created: int
    model: str
    include_usage: bool = False
    piece: PieceOf = _id_piece  # how logprobs show a token (`token_piece` of the model's tokenizer)
    post_sampling: bool = False  # chat: the logprobs are post-sampling, shown as llama-server's probabilities

    @classmethod
    def new(cls, endpoint: Endpoint, model: str, *, include_usage: bool = False,
            piece: PieceOf = _id_piece, post_sampling: bool = False) -> ResponseShape:
        """A fresh id (`cmpl-...` or `chatcmpl-...`) created now."""
        return cls(endpoint, endpoint.id_prefix + secrets.token_hex(12), int(time.time()), model, include_usage,
                   piece, post_sampling)

    def _head(self, object_name: str) -> JsonObject:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}

    def logprobs(self, entries: Sequence[TokenLogprobs] | None, offset: int = 0) -> JsonObject | None:
        """The `logprobs` of a choice or chunk in this endpoint's shape (None when not asked)."""
        if entries is None:
            return None
        if self.endpoint is Endpoint.COMPLETIONS:
            return completion_logprobs(entries, self.piece, offset)
        return chat_logprobs(entries, self.piece, post_sampling=self.post_sampling)

    def response(self, choices: Sequence[Choice], usage: Usage) -> JsonObject:
        """The whole (non-streamed) response, its choices in index order."""
        built = []
        for choice in sorted(choices, key=lambda c: c.index):
            entry: JsonObject = {"index": choice.index}
            if self.endpoint is Endpoint.COMPLETIONS:
                entry["text"] = choice.text
            elif choice.calls:
                entry["message"] = {"role": "assistant", "content": choice.text or None,
                                    "tool_calls": [call.as_json() for call in choice.calls]}
            else:
                entry["message"] = {"role": "assistant", "content": choice.text}
            if self.endpoint is Endpoint.CHAT and choice.reasoning:
                entry["message"]["reasoning_content"] = choice.reasoning
            entry |= {"logprobs": self.logprobs(choice.logprobs),
                      "finish_reason": finish_reason(choice.reason, called=bool(choice.calls))}
            built.append(entry)
        return self._head(self.endpoint.object_name) | {"choices": built, "usage": usage.as_dict()}

    def _chunk(self, content: JsonObject, reason: str | None, index: int = 0,
               logprobs: JsonObject | None = None) -> JsonObject:
        choice: JsonObject = {"index": index}
        if self.endpoint is Endpoint.COMPLETIONS:
            choice["text"] = content.get("content", "")
        else:
            choice["delta"] = content
        choice |= {"logprobs": logprobs, "finish_reason": reason}
        chunk = self._head(self.endpoint.chunk_object_name) | {"choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunk(self, index: int = 0) -> JsonObject | None:
        """Chat streams open with the assistant role (per choice); completion streams have no opening chunk."""
        if self.endpoint is Endpoint.COMPLETIONS:
            return None
        return self._chunk({"role": "assistant", "content": None}, None, index)  # llama-server: null beside the role

    def text_chunk(self, text: str, index: int = 0, logprobs: JsonObject | None = None) -> JsonObject:
        """A chunk carrying new text of choice `index` (and the logprobs of its tokens)."""
        return self._chunk({"content": text}, None, index, logprobs)

    def delta_chunk(self, delta: JsonObject, index: int = 0, logprobs: JsonObject | None = None) -> JsonObject:
        """A chat chunk carrying one delta of choice `index` (text, or a piece of a tool call)."""
        return self._chunk(delta, None, index, logprobs)

    def final_chunk(self, reason: str, index: int = 0, logprobs: JsonObject | None = None, *,
                    called: bool = False) -> JsonObject:
        """The chunk carrying choice `index`'s finish reason (no text; the logprobs of tokens not yet sent)."""
        return self._chunk({}, finish_reason(reason, called=called), index, logprobs)

    def progress_chunk(self, progress: JsonObject, index: int = 0) -> JsonObject:
        """llama-server's report of the prompt's progress in a stream (return_progress): a chunk without text
        (chat: the assistant role, as llama-server sends it) carrying `prompt_progress`."""
        content: JsonObject = {"content": ""} if self.endpoint is Endpoint.COMPLETIONS else {
            "role": "assistant", "content": None}
        return self._chunk(content, None, index) | {"prompt_progress": progress}

    def usage_chunk(self, usage: Usage) -> JsonObject:
        """With `stream_options.include_usage`: the last chunk, empty choices and the usage."""
        return self._head(self.endpoint.chunk_object_name) | {"choices": [], "usage": usage.as_dict()}


class ChoiceStreams:
    """The chunks of one streamed request, from the engine's deltas: each chunk carries one
    choice's new text with the logprobs of the tokens that text came from; logprobs of tokens
    whose text is held back (a possible stop string) or empty (EOS) wait for the next chunk of
    their choice, at the latest its finish chunk. Socket-free."""

    def __init__(self, shape: ResponseShape, n: int, *, logprobs: bool, tools: ToolAnswers | None = None,
                 reasoning: ReasoningReader | None = None) -> None:
        self.shape = shape
        self.n = n
        self.with_logprobs = logprobs
        # With tools, each choice's text is read for calls as it comes: deltas of text and of calls.
        self._calls = [tools.stream() for _ in range(n)] if tools is not None else None
        # With a thinking template, each choice's thought is read apart first: reasoning_content deltas.
        self._thoughts = [reasoning.stream() for _ in range(n)] if reasoning is not None else None
        self._pending: list[list[TokenLogprobs]] = [[] for _ in range(n)]
        self._offsets = [0] * n  # completions' text_offset of each choice's next token

    def opening(self) -> list[JsonObject]:
        """Chat: one role chunk per choice; completions: none."""
        chunks = [self.shape.first_chunk(index) for index in range(self.n)]
        return [chunk for chunk in chunks if chunk is not None]

    def _take(self, index: int) -> JsonObject | None:
        if not self.with_logprobs:
            return None
        entries, self._pending[index] = self._pending[index], []
        built = self.shape.logprobs(entries, self._offsets[index])
        if built is not None and self.shape.endpoint is Endpoint.COMPLETIONS:
            self._offsets[index] += sum(len(token) for token in built["tokens"])
        return built

    def delta(self, index: int, text: str, logprobs: Sequence[TokenLogprobs],
              progress: JsonObject | None = None) -> list[JsonObject]:
        """The chunks of one delta of choice `index` (none while its text is held back; a report of the prompt's
        `progress` is one chunk of its own)."""
        if progress is not None:
            return [self.shape.progress_chunk(progress, index)]
        if not 0 <= index < self.n:
            raise ApiError(500, f"the engine sent a delta of choice {index}; the request has choices 0..{self.n - 1}",
                           kind="server_error", code="internal_error")
        self._pending[index].extend(logprobs)
        if not text:
            return []
        if self._thoughts is None:
            return self._content_chunks(index, text)
        return self._thought_chunks(index, self._thoughts[index].feed(text))

    def _content_chunks(self, index: int, text: str) -> list[JsonObject]:
        """Chunks of a choice's answer text (read for calls with tools)."""
        if self._calls is None:
            return [self.shape.text_chunk(text, index, self._take(index))] if text else []
        return self._tool_chunks(index, self._calls[index].feed(text))

    def _thought_chunks(self, index: int, pieces: list[tuple[str, str]]) -> list[JsonObject]:
        """Chunks of a choice's thought (reasoning_content deltas) and answer text, in order."""
        chunks = []
        for kind, piece in pieces:
            if kind == REASONING:
                chunks.append(self.shape.delta_chunk({"reasoning_content": piece}, index, self._take(index)))
            else:
                chunks += self._content_chunks(index, piece)
        return chunks

    def _tool_chunks(self, index: int, deltas: list[dict[str, Any]]) -> list[JsonObject]:
        """Chunks of a choice's text and call deltas; the first carries the logprobs waiting."""
        return [self.shape.delta_chunk(delta, index, self._take(index) if k == 0 else None)
                for k, delta in enumerate(deltas)]

    def ending(self, results: Sequence[GenerationResult], usage: Usage | None = None) -> list[JsonObject]:
        """Every choice's finish chunk in index order, then the usage chunk if asked (`usage`; default:
        the choices' of one prompt)."""
        ordered = [result for result in sorted(results, key=lambda r: r.choice) if 0 <= result.choice < self.n]
        chunks = []
        for result in ordered:
            if self._thoughts is not None:
                chunks += self._thought_chunks(result.choice, self._thoughts[result.choice].finish())
            calls = None if self._calls is None else self._calls[result.choice]
            if calls is not None:
                chunks += self._tool_chunks(result.choice, calls.finish())
            chunks.append(self.shape.final_chunk(result.finish_reason, result.choice, self._take(result.choice),
                                                 called=calls is not None and bool(calls.calls)))
        if self.shape.include_usage:
            chunks.append(self.shape.usage_chunk(usage or Usage.of_all(results)))
        return chunks


def sse(payload: Mapping[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.encode("utf-8", "backslashreplace") + b"\n\n"  # a lone surrogate as its JSON escape


SSE_DONE = b"data: [DONE]\n\n"
"""The event that ends every OpenAI stream."""
