"""llama-server's own routes (docs/PROTOCOL.md §9.6): request bodies, answers and stream events; socket-free.

`TokenizeRequest` and `tokenize` (POST /tokenize), `DetokenizeRequest` and `detokenize` (POST
/detokenize), `ServerProps` (GET /props), and the native `POST /completion`: `NativeCompletion`
validates its body (every field checked; an unknown field is a 400 naming it; a batch of prompts
is one `NativeCompletion` each) into the same `CompletionParams` /v1/completions uses, and
`NativeShape` answers in llama-server's shape (`response_fields` picked by `pick_fields`). The
shapes follow the llama.cpp that llama-cpp-python 0.3.x vendors (token probabilities as
`{id, token, bytes, logprob, top_logprobs}`, llama.cpp's shape since its December 2024 server;
`{id, token, bytes, prob, top_probs}` with `post_sampling_probs`). `LlamaExtras` holds what
llama-server adds to its OpenAI-shaped answers (`timings`, `__verbose`).

Where llama-server's conventions differ from OpenAI's, these routes follow llama-server's: its
sampling defaults (`NATIVE_DEFAULTS`), `n_predict` -1 or more than fits meaning up to the context,
control-token texts in a text prompt parsed as control tokens, pieces rendered with them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from skippy_zmq import __version__, defaults
from skippy_zmq.driver.engine import PromptProgress
from skippy_zmq.driver.generation import GenerationRequest, GenerationResult, Timing
from skippy_zmq.errors import RequestJsonError, TokenizerError
from skippy_zmq.gateway.openai_api import (
    MAX_TOKENS_BOUND,
    REPEAT_PENALTY_RANGE,
    ApiError,
    CompletionParams,
    Endpoint,
    FieldCheck,
    JsonObject,
    boolean_field,
    chat_continuation,
    constraint_of,
    continue_final_field,
    grammar_field,
    integer_field,
    is_int,
    is_number,
    json_schema_field,
    number_field,
    object_field,
    regex_field,
    response_format_field,
    shown_value,
    string_field,
    thinking_of,
    tool_choice_field,
    tool_list_field,
    tools_of,
)
from skippy_zmq.gateway.reasoning import DEFAULT_THINKING, Thinking
from skippy_zmq.gateway.request_json import OversizedInteger, RequestJson, shown
from skippy_zmq.gateway.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from skippy_zmq.gateway.tool_calls import Tools
from skippy_zmq.tokens.constraint import Constraint
from skippy_zmq.tokens.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from skippy_zmq.tokens.sampling import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, PENALTY_RANGE
from skippy_zmq.tokens.tokenizer import Tokenizer
from skippy_zmq.wire.messages import MAX_DRAFT_TOKENS

MAX_BATCH_PROMPTS = 64
"""Prompts one /completion request may batch (llama-server sets no limit; each is a request on the engine)."""
MAX_RESPONSE_FIELDS = 64
"""Paths one /completion request's `response_fields` may list."""
MAX_NATIVE_STOP_STRINGS = 16
"""Stop strings one /completion request may give (llama-server sets no limit; this bounds the hold-back)."""
SAMPLER_ORDER = ("penalties", "top_k", "top_p", "min_p", "temperature")
"""The sampler chain in llama-server's names, in the order it runs (docs/PROTOCOL.md §5)."""
_MAX_TOKEN_ID = 2**31 - 1
_SEED_LIMIT = 2**64
_TEMPERATURE_BOUND = 1e6  # carried as a float32 (docs/PROTOCOL.md §2.2)


@attrs.frozen
class NativeDefaults:
    """The sampling settings /completion applies to a field left out (llama-server's defaults)."""

    n_predict: int = -1
    temperature: float = defaults.TEMPERATURE
    top_k: int = defaults.TOP_K
    top_p: float = defaults.TOP_P
    min_p: float = defaults.MIN_P
    repeat_penalty: float = defaults.REPEAT_PENALTY
    repeat_last_n: int = defaults.REPEAT_LAST_N
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


NATIVE_DEFAULTS = NativeDefaults()


# --- field checks -------------------------------------------------------------------------------


def _neutral(*accepted: object) -> FieldCheck:
    """A llama-server field this server does not act on: only its neutral value is accepted."""

    def check(value: Any, name: str) -> Any:
        if not any(type(value) is type(ok) and value == ok for ok in accepted) and not (
                is_number(value) and any(is_number(ok) and value == ok for ok in accepted)):
            shown_ok = " or ".join(_json_shown(ok) for ok in accepted)
            raise ApiError.invalid(name, f"{name} {_json_shown(value)} is not supported; only {shown_ok} (or null) "
                                   "is accepted")
        return value

    return check


def _json_shown(value: Any) -> str:
    """A value as the client wrote it (JSON: `true`, `[...]`), cut to 80 characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return shown_value(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _strings(value: Any, name: str) -> Any:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ApiError.invalid(name, f"{name} must be a list of strings, got {shown_value(value)}")
    return value


def _logit_bias(value: Any, name: str) -> tuple[tuple[int | str, float], ...]:
    """llama-server's logit_bias: `[[id, bias], ...]` (bias a number, or false to ban the token)
    or `{"id": bias}`; a text in place of an id biases each of its tokens (`NativeCompletion.tokenized`)."""
    if isinstance(value, dict):
        pairs: list[Any] = [[int(key) if key.isascii() and key.isdigit() else key, bias]
                            for key, bias in value.items()]
    elif isinstance(value, list) and all(isinstance(pair, list) and len(pair) == 2 for pair in value):
        pairs = list(value)
    else:
        raise ApiError.invalid(name, f"{name} must be [[token id, bias], ...] or an object of token ids, got "
                               f"{shown_value(value)}")
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ApiError.invalid(name, f"{name} has {len(pairs)} entries; at most {MAX_LOGIT_BIAS} are accepted")
    biased: dict[int | str, float] = {}
    low, high = LOGIT_BIAS_RANGE
    for index, (token, given) in enumerate(pairs):
        if not isinstance(token, str) and (not is_int(token) or not 0 <= token <= _MAX_TOKEN_ID):
            raise ApiError.invalid(name, f"{name}[{index}] token id {shown_value(token)} must be an integer in "
                                   f"[0, {_MAX_TOKEN_ID}] or a text")
        bias = low if given is False else given  # false bans the token in llama-server; -100 does here (§5)
        if not is_number(bias) or not low <= bias <= high:
            raise ApiError.invalid(name, f"{name}[{index}] bias {shown_value(given)} must be a number in "
                                   f"[{low:g}, {high:g}] or false")
        if token in biased:
            raise ApiError.invalid(name, f"{name} names token {token} twice")
        biased[token] = float(bias)
    return tuple(biased.items())


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ApiError.invalid(name, f"{name} must be a list of token ids, got {shown_value(value)}")
    for index, item in enumerate(value):
        if not is_int(item) or not 0 <= item <= _MAX_TOKEN_ID:
            raise ApiError.invalid(name, f"{name}[{index}] is {shown_value(item)}; token ids are integers in "
                                   f"[0, {_MAX_TOKEN_ID}]")
    return tuple(value)


Prompt = str | tuple[int | str, ...]
"""One /completion prompt: text, or token ids among texts (texts until `NativeCompletion.tokenized`)."""


def _prompts(value: Any, name: str) -> tuple[Prompt, ...]:
    """llama-server's `prompt`: one prompt, or a batch of them: a list that holds no number is a list
    of prompts (`[[ids], "text", {"prompt_string": ...}]`), one request each; a list with numbers is
    one prompt (ids, or ids among texts)."""
    if not isinstance(value, list) or any(is_number(v) or isinstance(v, OversizedInteger) for v in value):
        return (_prompt(value, name),)
    if not value:
        raise ApiError.invalid(name, f"{name} must not be empty: give a string, token ids, or a list of prompts")
    if len(value) > MAX_BATCH_PROMPTS:
        raise ApiError.invalid(name, f"{name} holds {len(value)} prompts; at most {MAX_BATCH_PROMPTS} are accepted "
                               "in one request")
    return tuple(_prompt(item, f"{name}[{index}]") for index, item in enumerate(value))


def _prompt(value: Any, name: str) -> Prompt:
    """Text, a list of token ids and texts (llama-server's mixed prompt: `[12, 34, "text", 56]`), or
    `{"prompt_string": text}`."""
    if isinstance(value, dict):
        value = _json_prompt(value, name)
    if isinstance(value, str):
        return value
    is_id = [is_int(v) or isinstance(v, OversizedInteger) for v in value] if isinstance(value, list) else []
    if is_id and all(is_id):
        return _token_ids(value, name)
    if any(is_id) and all(ok or isinstance(v, str) for ok, v in zip(is_id, value, strict=True)):
        _token_ids([v for ok, v in zip(is_id, value, strict=True) if ok], name)  # the ids' bounds
        return tuple(value)
    raise ApiError.invalid(name, f"{name} must be a string, a non-empty list of token ids and texts, or "
                           '{"prompt_string": text}')


def _json_prompt(value: Mapping[str, Any], name: str) -> str:
    """llama-server's JSON-object prompt, `{"prompt_string": text}`; its `multimodal_data` is refused."""
    unknown = sorted(set(value) - {"prompt_string", "multimodal_data"})
    if unknown:
        raise ApiError.invalid(name, f"{name} object holds {shown_value(unknown[0])}; it may hold prompt_string "
                               "(and multimodal_data)")
    if value.get("multimodal_data"):
        raise ApiError.invalid(name, f"{name}.multimodal_data: this server takes no images or audio")
    text = value.get("prompt_string")
    if not isinstance(text, str):
        raise ApiError.invalid(name, f"{name}.prompt_string must be a string, got {shown_value(text)}")
    return text


def _stop(value: Any, name: str) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
        raise ApiError.invalid(name, f"{name} must be a list of strings, got {shown_value(value)}")
    if len(stops) > MAX_NATIVE_STOP_STRINGS:
        raise ApiError.invalid(name, f"{name} has {len(stops)} strings; at most {MAX_NATIVE_STOP_STRINGS} are "
                               "accepted")
    return tuple(stop for stop in stops if stop)


def _response_fields(value: Any, name: str) -> tuple[str, ...]:
    """llama-server's `response_fields`: the answer's fields to keep, a nested one as its `a/b` path."""
    paths = _strings(value, name)
    if len(paths) > MAX_RESPONSE_FIELDS:
        raise ApiError.invalid(name, f"{name} has {len(paths)} paths; at most {MAX_RESPONSE_FIELDS} are accepted")
    return tuple(paths)


def _seed(value: Any, name: str) -> int | None:
    if not is_int(value) or not -1 <= value < _SEED_LIMIT:
        raise ApiError.invalid(name, f"{name} must be an integer in [0, 2**64), or -1 for a random seed, got "
                               f"{shown_value(value)}")
    return None if value == -1 else int(value)


def _parse(body: Any, fields: Mapping[str, FieldCheck], route: str) -> dict[str, Any]:
    """Every non-null field of `body`, checked; an unknown field is a 400 naming it."""
    if not isinstance(body, dict):
        raise ApiError.invalid(None, f"the request body of {route} must be a JSON object")
    parsed: dict[str, Any] = {}
    for name, value in body.items():
        check = fields.get(name)
        if check is None:
            raise ApiError.invalid(shown(name), f"unknown field {shown_value(name)}: {route} does not accept it")
        if value is not None:
            parsed[name] = check(value, name)
    return parsed


def read_json(data: bytes) -> Any:
    """A request body as JSON: ApiError 400 when it is not UTF-8 JSON or holds text that is not
    valid Unicode (docs/PROTOCOL.md §9.3)."""
    try:
        return RequestJson.parse(data, "request body").checked()
    except RequestJsonError as exc:
        raise ApiError.from_exception(exc) from None


# --- /tokenize and /detokenize -----------------------------------------------------------------


def piece_json(piece: bytes) -> str | list[int]:
    """A token's piece as llama-server's /tokenize gives it: text when the bytes are valid UTF-8
    on their own, else the list of byte values."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


_TOKENIZE_FIELDS: Mapping[str, FieldCheck] = {
    "content": string_field,
    "add_special": boolean_field,
    "parse_special": boolean_field,
    "with_pieces": boolean_field,
}


@attrs.frozen
class TokenizeRequest:
    """POST /tokenize: text to token ids (llama-server's defaults: no BOS, special texts parsed)."""

    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False

    @classmethod
    def from_body(cls, body: Any) -> TokenizeRequest:
        """Validate the parsed JSON body; ApiError 400 naming the first bad field."""
        fields = _parse(body, _TOKENIZE_FIELDS, "/tokenize")
        if "content" not in fields:
            raise ApiError.invalid("content", "content is required: the text to tokenize")
        return cls(**fields)


def tokenize(tokenizer: Tokenizer, request: TokenizeRequest) -> JsonObject:
    """The answer to /tokenize: `{"tokens": [ids]}`, or with pieces `{"tokens": [{"id", "piece"}]}`;
    `add_special` adds what the vocabulary asks for around a text (BOS, EOS; CLS and SEP), as llama.cpp."""
    try:
        ids = tokenizer.encode(request.content, add_special=request.add_special, parse_special=request.parse_special)
    except TokenizerError as exc:  # text that is not Unicode, or a vocab asking for a token it lacks
        raise ApiError.invalid("content", f"content cannot be tokenized: {exc}") from None
    if not request.with_pieces:
        return {"tokens": ids}
    return {"tokens": [{"id": i, "piece": piece_json(tokenizer.token_piece(i, special=True))} for i in ids]}


@attrs.frozen
class DetokenizeRequest:
    """POST /detokenize: token ids to text."""

    tokens: tuple[int, ...] = ()

    @classmethod
    def from_body(cls, body: Any) -> DetokenizeRequest:
        """Validate the parsed JSON body; ApiError 400 naming the first bad field."""
        fields = _parse(body, {"tokens": _token_ids}, "/detokenize")
        return cls(fields.get("tokens", ()))


def _message_list(value: Any, name: str) -> Any:
    if not isinstance(value, list) or not value:
        raise ApiError.invalid(name, f"{name} must be a non-empty list of message objects, got {shown_value(value)}")
    return value


_APPLY_TEMPLATE_FIELDS: Mapping[str, FieldCheck] = {
    "messages": _message_list,
    "tools": tool_list_field,
    "tool_choice": tool_choice_field,
    "parallel_tool_calls": boolean_field,
    "add_generation_prompt": boolean_field,
    "continue_final_message": continue_final_field,
    "model": string_field,
    "chat_template_kwargs": object_field,
    "reasoning_effort": string_field,
}


@attrs.frozen
class ApplyTemplateRequest:
    """POST /apply-template: chat messages (and tools) to the prompt text the chat template renders."""

    messages: tuple[Mapping[str, Any], ...]
    tools: Tools | None = None
    add_generation_prompt: bool = True
    continue_final: bool = False  # the last (assistant) message continued, as chat's (docs/PROTOCOL.md §9.2)
    thinking: Thinking = DEFAULT_THINKING  # the server's thought settings, then the request's

    @classmethod
    def from_body(cls, body: Any, defaults: SamplingDefaults = NO_DEFAULTS) -> ApplyTemplateRequest:
        """Validate the parsed JSON body; ApiError 400 naming the first bad field (the messages
        themselves are checked as the template reads them)."""
        fields = _parse(body, _APPLY_TEMPLATE_FIELDS, "/apply-template")
        if "messages" not in fields:
            raise ApiError.invalid("messages", "messages is required")
        generation, continuing = chat_continuation(fields)
        return cls(tuple(fields["messages"]), tools_of(fields), generation, continuing,
                   thinking_of(fields, defaults.thinking))


def detokenize(tokenizer: Tokenizer, request: DetokenizeRequest) -> JsonObject:
    """The answer to /detokenize: the pieces joined (control tokens as their text, as llama-server),
    bytes that are not UTF-8 as U+FFFD; an id outside the vocab is a 400 naming it."""
    for index, token in enumerate(request.tokens):
        if token >= tokenizer.n_vocab:
            raise ApiError.invalid("tokens", f"tokens[{index}] is {token}; the vocabulary has ids "
                                   f"0..{tokenizer.n_vocab - 1}")
    return {"content": _text(tokenizer, request.tokens)}


def _text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    return b"".join(tokenizer.token_piece(i, special=True) for i in ids).decode("utf-8", "replace")


# --- /props -------------------------------------------------------------------------------------


@attrs.frozen
class ServerProps:
    """What GET /props reports: the model, its context, the lanes, the chat template, the defaults."""

    model_id: str
    model_path: str
    n_ctx: int
    total_slots: int
    chat_template: str | None = None
    sampling: SamplingDefaults = NO_DEFAULTS
    is_sleeping: bool = False  # serve --sleep-idle-seconds stopped the stages (PROTOCOL §9.6, Sleeping)

    def as_json(self) -> JsonObject:
        """llama-server's /props fields that are true of this server."""
        return {
            "is_sleeping": self.is_sleeping,
            "default_generation_settings": {"n_ctx": self.n_ctx, "params": default_settings(self.sampling)},
            "total_slots": self.total_slots,
            "model_alias": self.model_id,
            "model_path": self.model_path,
            "chat_template": self.chat_template,
            "modalities": {"vision": False, "audio": False},
            "build_info": f"skippy-zmq {__version__}",
        }


def default_settings(sampling: SamplingDefaults = NO_DEFAULTS) -> JsonObject:
    """The settings /completion applies to the fields a request leaves out (`serve --seed`, `--temp` and
    their kin in place of llama-server's own; seed -1: a random seed per request)."""
    native = attrs.evolve(NATIVE_DEFAULTS, **{k: v for k, v in sampling.given().items() if k != "seed"})
    return {
        "n_predict": native.n_predict, "seed": -1 if sampling.seed is None else sampling.seed,
        "temperature": native.temperature, "top_k": native.top_k,
        "top_p": native.top_p, "min_p": native.min_p, "repeat_penalty": native.repeat_penalty,
        "repeat_last_n": native.repeat_last_n, "presence_penalty": native.presence_penalty,
        "frequency_penalty": native.frequency_penalty, "stop": [], "ignore_eos": False, "stream": False,
        "n_probs": 0, "samplers": list(SAMPLER_ORDER),
    }


# --- /completion --------------------------------------------------------------------------------

NATIVE_FIELDS: Mapping[str, FieldCheck] = {
    "prompt": _prompts,
    "model": string_field,
    "n_predict": integer_field(-1, MAX_TOKENS_BOUND),
    # llama-server's aliases of n_predict, read when it is absent (n_predict first, then these in order)
    "max_tokens": integer_field(-1, MAX_TOKENS_BOUND),
    "max_completion_tokens": integer_field(-1, MAX_TOKENS_BOUND),
    "stream": boolean_field,
    "stop": _stop,
    "temperature": number_field(-_TEMPERATURE_BOUND, _TEMPERATURE_BOUND),
    "top_k": integer_field(-(2**31), 2**31 - 1),
    "top_p": number_field(0, 1),
    "min_p": number_field(0, 1),
    "seed": _seed,
    "n_probs": integer_field(0, MAX_TOP_LOGPROBS),
    "ignore_eos": boolean_field,
    "repeat_penalty": number_field(*REPEAT_PENALTY_RANGE),
    "repeat_last_n": integer_field(-1, 2**31 - 1),
    "presence_penalty": number_field(*PENALTY_RANGE),
    "frequency_penalty": number_field(*PENALTY_RANGE),
    "return_tokens": boolean_field,
    "response_fields": _response_fields,
    "post_sampling_probs": boolean_field,
    "verbose": boolean_field,  # accepted: __verbose belongs to the OpenAI-shaped answers (§9.6)
    "backend_sampling": boolean_field,  # accepted: where the sampler runs; the final stage samples either way
    "logit_bias": _logit_bias,
    "cache_prompt": boolean_field,  # false: this request never continues a retained session (PROTOCOL §6)
    "response_format": response_format_field,
    "json_schema": json_schema_field,
    "grammar": grammar_field,
    "regex": regex_field,
    # accepted and ignored: the context never shifts
    "n_keep": integer_field(-1, 2**31 - 1),
    "n_discard": integer_field(0, 2**31 - 1),
    # accepted and ignored: parameters of samplers whose switch below is accepted off only, so
    # they change nothing (as in llama-server with those samplers off); their types are checked
    "mirostat_tau": number_field(0, 1e6),
    "mirostat_eta": number_field(0, 1e6),
    "dry_base": number_field(0, 1e6),
    "dry_allowed_length": integer_field(0, 2**31 - 1),
    "dry_penalty_last_n": integer_field(-1, 2**31 - 1),
    "dry_sequence_breakers": _strings,
    "xtc_threshold": number_field(0, 1),
    "dynatemp_exponent": number_field(0, 1e6),
    # llama-server fields accepted at their neutral value only
    "id_slot": _neutral(-1),
    "typical_p": _neutral(1.0),
    "mirostat": _neutral(0),
    "dry_multiplier": _neutral(0.0),
    "xtc_probability": _neutral(0.0),
    "dynatemp_range": _neutral(0.0),
    "min_keep": _neutral(0),
    "n_indent": _neutral(0),
    "t_max_predict_ms": _neutral(0),
    "timings_per_token": boolean_field,  # a stream's every event carries `timings`
    "return_progress": boolean_field,  # a stream reports the prompt's progress (PROTOCOL §9.6)
    # most drafts a decode step carries (PROTOCOL §6, Speculative decoding); a draft model's thresholds n_min
    # and p_min are type-checked and ignored: n-gram drafts are sized by what the session's steps accepted
    "speculative.n_max": integer_field(0, MAX_DRAFT_TOKENS),
    "speculative.n_min": integer_field(0, MAX_DRAFT_TOKENS),
    "speculative.p_min": number_field(0, 1),
    "samplers": _neutral(list(SAMPLER_ORDER)),  # the order /props reports: the chain is fixed (§5)
}
"""Every field POST /completion accepts and its check (docs/PROTOCOL.md §9.6)."""


@attrs.frozen
class NativeCompletion:
    """A validated POST /completion body (llama-server's defaults for what it leaves out)."""

    prompt: Prompt  # texts among ids until `tokenized`
    model: str | None = None
    n_predict: int = NATIVE_DEFAULTS.n_predict
    stream: bool = False
    stop: tuple[str, ...] = ()
    temperature: float = NATIVE_DEFAULTS.temperature
    top_k: int = NATIVE_DEFAULTS.top_k
    top_p: float = NATIVE_DEFAULTS.top_p
    min_p: float = NATIVE_DEFAULTS.min_p
    seed: int | None = None  # None: a random seed
    n_probs: int = 0
    post_sampling_probs: bool = False  # n_probs after the sampler's filters, as probabilities (§9.6)
    ignore_eos: bool = False
    cache_prompt: bool = True
    repeat_penalty: float = NATIVE_DEFAULTS.repeat_penalty
    repeat_last_n: int = NATIVE_DEFAULTS.repeat_last_n
    presence_penalty: float = NATIVE_DEFAULTS.presence_penalty
    frequency_penalty: float = NATIVE_DEFAULTS.frequency_penalty
    return_tokens: bool = False
    response_fields: tuple[str, ...] = ()  # the answer's fields to keep (all when empty)
    logit_bias: tuple[tuple[int | str, float], ...] = ()  # texts in place of ids until `tokenized`
    constraint: Constraint | None = None
    index: int = 0  # the prompt's place in its request's batch
    timings_per_token: bool = False
    return_progress: bool = False
    draft_max: int | None = None  # speculative.n_max (None: `serve --draft-max`)

    @classmethod
    def from_json(cls, data: bytes, defaults: SamplingDefaults = NO_DEFAULTS) -> NativeCompletion:
        """Validate a body of one prompt as received (`read_json`, then `from_body`)."""
        return cls.from_body(read_json(data), defaults)

    @classmethod
    def from_body(cls, body: Any, defaults: SamplingDefaults = NO_DEFAULTS) -> NativeCompletion:
        """Validate a parsed JSON body of one prompt (`batch_from_body` takes several)."""
        batch = cls.batch_from_body(body, defaults)
        if len(batch) != 1:
            raise ApiError.invalid("prompt", f"prompt holds {len(batch)} prompts; one is expected here")
        return batch[0]

    @classmethod
    def batch_from_json(cls, data: bytes, defaults: SamplingDefaults = NO_DEFAULTS) -> tuple[NativeCompletion, ...]:
        """Validate a body as received (`read_json`, then `batch_from_body`)."""
        return cls.batch_from_body(read_json(data), defaults)

    @classmethod
    def batch_from_body(cls, body: Any, defaults: SamplingDefaults = NO_DEFAULTS) -> tuple[NativeCompletion, ...]:
        """Validate the parsed JSON body; ApiError 400 naming the first bad field. One request per prompt
        (several for a batch, `index` their places), each with the body's other fields. A sampling field
        left out takes the server's default (`defaults`), else llama-server's."""
        fields = _parse(body, NATIVE_FIELDS, "/completion")
        if "prompt" not in fields:
            raise ApiError.invalid("prompt", "prompt is required: text or a list of token ids")
        for alias in ("max_tokens", "max_completion_tokens"):  # llama-server reads an alias without n_predict
            if alias in fields and "n_predict" not in fields:
                fields["n_predict"] = fields[alias]
        if "speculative.n_max" in fields:
            fields["draft_max"] = fields["speculative.n_max"]
        known = attrs.fields_dict(cls)
        given = {name: value for name, value in fields.items() if name in known and name != "prompt"}
        settings = defaults.given() | given
        constraint = constraint_of(fields)
        return tuple(cls(prompt, **settings, constraint=constraint, index=index)
                     for index, prompt in enumerate(fields["prompt"]))

    def tokenized(self, tokenizer: Tokenizer) -> NativeCompletion:
        """The request with the texts of a mixed prompt and of `logit_bias` turned into token ids, as
        llama-server does: a mixed prompt's texts with control-token texts parsed, BOS before a first text
        when the vocabulary asks for it; each token of a bias text gets the bias (a later entry wins)."""
        prompt: str | tuple[int | str, ...] = self.prompt
        if isinstance(prompt, tuple) and any(isinstance(part, str) for part in prompt):
            ids: list[int] = []
            for index, part in enumerate(prompt):
                ids += (tokenizer.encode(part, add_special=index == 0, parse_special=True)
                        if isinstance(part, str) else [part])
            prompt = tuple(ids)
        biased: dict[int, float] = {}
        for token, bias in self.logit_bias:
            for token_id in (tokenizer.encode(token, add_special=False) if isinstance(token, str) else [token]):
                biased[token_id] = bias
        if len(biased) > MAX_LOGIT_BIAS:
            raise ApiError.invalid("logit_bias", f"logit_bias names {len(biased)} tokens; at most {MAX_LOGIT_BIAS} "
                                   "are accepted")
        return attrs.evolve(self, prompt=prompt, logit_bias=tuple(sorted(biased.items())))

    def params(self) -> CompletionParams:
        """The /v1/completions request this is: n_predict -1 as no max_tokens (the gateway then
        fills the context), a temperature <= 0 or top_k <= 0 as llama-server reads them. Texts among the
        prompt's ids and in `logit_bias` must have been `tokenized`."""
        texts = not isinstance(self.prompt, str) and any(isinstance(part, str) for part in self.prompt)
        assert not texts and all(isinstance(token, int) for token, _ in self.logit_bias), "tokenized() first"
        prompt = self.prompt if isinstance(self.prompt, str) else tuple(p for p in self.prompt if isinstance(p, int))
        logit_bias = tuple((token, bias) for token, bias in self.logit_bias if isinstance(token, int))
        return CompletionParams(
            endpoint=Endpoint.COMPLETIONS, model=self.model, prompt=prompt,
            max_tokens=None if self.n_predict < 0 else self.n_predict, max_tokens_field="n_predict",
            temperature=max(self.temperature, 0.0), top_p=self.top_p, top_k=max(self.top_k, 0), min_p=self.min_p,
            repeat_penalty=self.repeat_penalty, seed=self.seed, ignore_eos=self.ignore_eos, stop=self.stop,
            stream=self.stream, logprobs=self.n_probs or None, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, logit_bias=logit_bias, cache_prompt=self.cache_prompt,
            constraint=self.constraint, return_progress=self.return_progress, timings_per_token=self.timings_per_token,
            draft_max=self.draft_max,
        )

    def finish(self, request: GenerationRequest) -> GenerationRequest:
        """The engine request with what CompletionParams does not carry: repeat_last_n, and (so the
        route does not depend on how /v1 passes them on) n_probs and the two penalties."""
        sampling = attrs.evolve(request.sampling, penalty_last_n=self.repeat_last_n,
                                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)
        return attrs.evolve(request, sampling=sampling, logprobs=self.n_probs or None,
                            post_sampling_probs=self.post_sampling_probs and self.n_probs > 0)

    def settings(self, request: GenerationRequest, eog_ids: Iterable[int] = ()) -> JsonObject:
        """`generation_settings`: what this request ran with (the seed drawn when none was given), and
        `logit_bias` as llama-server lists it: with `ignore_eos`, the end-of-generation ids (`eog_ids`)
        at -inf (null in JSON)."""
        sampling = request.sampling
        banned = sorted(eog_ids) if self.ignore_eos else []
        biases = [{"bias": bias, "token": token} for token, bias in sampling.logit_bias if token not in banned]
        return {
            "logit_bias": biases + [{"bias": None, "token": token} for token in banned],
            "n_predict": self.n_predict, "seed": sampling.seed, "temperature": self.temperature, "top_k": self.top_k,
            "top_p": self.top_p, "min_p": self.min_p, "repeat_penalty": self.repeat_penalty,
            "repeat_last_n": self.repeat_last_n, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "stop": list(self.stop), "ignore_eos": self.ignore_eos,
            "stream": self.stream, "n_probs": self.n_probs, "post_sampling_probs": self.post_sampling_probs,
            "max_tokens": request.max_tokens, "samplers": list(SAMPLER_ORDER),
        }


# --- answers ------------------------------------------------------------------------------------

STOP_TYPES: Mapping[str, str] = {"eos": "eos", "stop": "word", "length": "limit"}
"""llama-server's `stop_type` for a session's finish reason."""


def _complete_utf8(data: bytes) -> bytes:
    """`data` without a trailing multi-byte UTF-8 sequence that is cut short (llama.cpp's validate_utf8)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:
            continue  # a continuation byte: look further back for its lead byte
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        return data[:-back] if need > back else data
    return data


def _token_entry(tokenizer: Tokenizer, token: int, logprob: float, *, post_sampling: bool = False) -> JsonObject:
    piece = tokenizer.token_piece(token, special=False)
    value = {"prob": math.exp(logprob)} if post_sampling else {"logprob": logprob}
    return {"id": token, "token": _complete_utf8(piece).decode("utf-8", "replace"), "bytes": list(piece)} | value


def completion_probabilities(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprobs], *,
                             post_sampling: bool = False) -> list[JsonObject]:
    """`completion_probabilities`: per generated token its id, text, bytes and logprob, and its
    most likely alternatives in `top_logprobs` (best first); with `post_sampling` (the values are of
    the sampler's final candidates), `prob` and `top_probs` in their place, as llama-server."""
    top_name = "top_probs" if post_sampling else "top_logprobs"
    return [
        _token_entry(tokenizer, entry.token, entry.logprob, post_sampling=post_sampling)
        | {top_name: [_token_entry(tokenizer, token, value, post_sampling=post_sampling) for token, value in entry.top]}
        for entry in logprobs
    ]


def pick_fields(answer: JsonObject, paths: Sequence[str]) -> JsonObject:
    """llama-server's `response_fields`: only the listed paths of `answer`, each under its path as the
    key (`generation_settings/n_predict` picks a nested value); a path that names nothing is left out."""
    picked: JsonObject = {}
    for path in paths:
        value: Any = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            picked[path] = value
    return picked


def stopping_word(tokenizer: Tokenizer, result: GenerationResult, stops: Sequence[str]) -> str:
    """The stop string that ended `result` ("" when none did): the first of `stops` that the
    generated text, before its cut, continues with where the answered text ends."""
    if result.finish_reason != "stop" or not stops:
        return ""
    # The answered text is the generated text cut where the stop string begins (docs/PROTOCOL.md §6).
    rest = tokenizer.decode(result.tokens)[len(result.text):]
    return next((stop for stop in stops if rest.startswith(stop)), "")


def timings(result: GenerationResult | Timing) -> JsonObject:
    """llama-server's `timings` of a result (or of its `Timing` at one moment of its stream): the prompt from
    taking a lane to the first token, generation from the first token to the last (ms), and the rates (0.0
    when no time was measured, as llama-server); the generation's rates count the steps after the first
    token, which the prompt's last step gave; `cache_n` prompt tokens a kept session held, `prompt_n` the
    ones computed (docs/PROTOCOL.md §6, Prompt cache)."""
    at = result.timing() if isinstance(result, GenerationResult) else result
    prompt_n, predicted_n = at.prompt_tokens - at.cached_tokens, at.tokens
    first = at.first_token_s if predicted_n else at.finished_s
    prompt_ms = max(first - at.started_s, 0.0) * 1e3 if at.started_s else 0.0
    predicted_ms = max(at.finished_s - at.first_token_s, 0.0) * 1e3 if predicted_n else 0.0

    def rates(count: int, ms: float) -> tuple[float, float]:
        return (ms / count if count else 0.0), (count * 1e3 / ms if ms > 0 else 0.0)

    prompt_per_token, prompt_per_second = rates(prompt_n, prompt_ms)
    predicted_per_token, predicted_per_second = rates(max(predicted_n - 1, 0), predicted_ms)
    drafted = {"draft_n": at.drafts, "draft_n_accepted": at.drafts_accepted} if at.drafts else {}
    return {
        "cache_n": at.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_per_token, "prompt_per_second": prompt_per_second,
        "predicted_n": predicted_n, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_per_token, "predicted_per_second": predicted_per_second,
        **drafted,  # llama-server's, when the request's decode steps carried drafts
    }


def result_answer(model: str, tokenizer: Tokenizer, result: GenerationResult, n_ctx: int,
                  stops: Sequence[str] = ()) -> JsonObject:
    """One finished generation in /completion's shape (llama-server's `to_json_non_oaicompat`), without
    what only /completion's own request knows (its `generation_settings`)."""
    prompt_n, predicted_n = len(result.prompt_ids), len(result.tokens)
    return {
        "index": result.choice,
        "content": result.text,
        "tokens": list(result.tokens),
        "stop": True,
        "model": model,
        "tokens_predicted": predicted_n,
        "tokens_evaluated": prompt_n,
        "tokens_cached": result.cached_tokens,
        "prompt": _text(tokenizer, result.prompt_ids),
        "has_new_line": "\n" in result.text,
        "truncated": result.finish_reason == "length" and prompt_n + predicted_n >= n_ctx,
        "stop_type": STOP_TYPES.get(result.finish_reason, "none"),
        "stopping_word": stopping_word(tokenizer, result, stops),
        "timings": timings(result),
    }


@attrs.frozen
class LlamaExtras:
    """What llama-server adds to its OpenAI-shaped answers: `timings` on the last object (a stream's
    last chunk), and with `verbose` the result in /completion's shape as `__verbose` on the first
    (docs/PROTOCOL.md §9.6); of the first choice when there are several."""

    model: str
    tokenizer: Tokenizer
    n_ctx: int
    stops: tuple[str, ...] = ()
    verbose: bool = False

    def added(self, objects: list[JsonObject], results: Sequence[GenerationResult]) -> list[JsonObject]:
        """`objects` (the answer, or a stream's last chunks) with the additions, in place."""
        if objects and results:
            first = min(results, key=lambda result: result.choice)
            objects[-1]["timings"] = timings(first)
            if self.verbose:
                objects[0]["__verbose"] = result_answer(self.model, self.tokenizer, first, self.n_ctx, self.stops)
        return objects


@attrs.frozen
class NativeShape:
    """Builds one /completion request's answer, or its stream events, in llama-server's shape."""

    model: str
    request: NativeCompletion
    generation: GenerationRequest
    tokenizer: Tokenizer
    n_ctx: int

    def partial(self, text: str, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
                predicted: int, timing: Timing | None = None) -> JsonObject:
        """A stream event for new output (`predicted`: tokens generated so far; `timing`: the timings so far,
        with timings_per_token)."""
        event: JsonObject = {"index": self.request.index, "content": text, "tokens": list(token_ids), "stop": False,
                             "tokens_predicted": predicted, "tokens_evaluated": len(self.generation.prompt_ids or ())}
        if self.request.n_probs and logprobs:
            event["completion_probabilities"] = self._probabilities(logprobs)
        if timing is not None:
            event["timings"] = timings(timing)
        return event

    def progress(self, progress: PromptProgress, timing: Timing | None = None) -> JsonObject:
        """A stream event reporting the prompt's progress (return_progress), with its timings (timings_per_token)."""
        return self.partial("", (), (), 0, timing) | {"prompt_progress": progress.as_json()}

    def _probabilities(self, logprobs: Sequence[TokenLogprobs]) -> list[JsonObject]:
        return completion_probabilities(self.tokenizer, logprobs, post_sampling=self.generation.post_sampling_probs)

    def final(self, result: GenerationResult) -> JsonObject:
        """The whole answer, or a stream's last event (its text and ids went in earlier events)."""
        stream = self.request.stream
        answer = result_answer(self.model, self.tokenizer, result, self.n_ctx, self.request.stop) | {
            "index": self.request.index,
            "content": "" if stream else result.text,
            "tokens": list(result.tokens) if self.request.return_tokens and not stream else [],
            "generation_settings": self.request.settings(self.generation, self.tokenizer.eog_ids),
        }
        if self.request.n_probs and not stream:
            answer["completion_probabilities"] = self._probabilities(result.logprobs)
        return pick_fields(answer, self.request.response_fields) if self.request.response_fields else answer
