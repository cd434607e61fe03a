"""OpenAI tool calling, the values: a request's `tools`, `tool_choice` and `parallel_tool_calls`
validated into `Tools`, the calls a model made (`ToolCall`, `ParsedAnswer`), and the JSON reading the
call formats share (tool_formats.py): a scanner that reads a JSON value that may still be arriving
and writes it compact as far as it is known, so a call's streamed arguments are always a prefix of
its final ones. Socket-free.

Arguments are the model's JSON re-written compact (`{"a":1,"b":"é"}`: no spaces, UTF-8 kept), as
llama-server dumps the arguments it parsed; keys keep their order, numbers are written as Python's
`json` writes the value they denote.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from skippy_zmq.errors import RequestError
from skippy_zmq.gateway.request_json import json_kind

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")
_ALPHANUMERIC = string.ascii_letters + string.digits
CALL_ID_PREFIX = "call_"
CALL_ID_LENGTH = 24


@attrs.frozen
class ToolSpec:
    """One function the model may call: its name, description and JSON schema of its arguments."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    strict: bool = False

    def as_template_json(self) -> dict[str, Any]:
        """The tool as llama-server hands it to a chat template (`{"type": "function", "function": ...}`)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@attrs.frozen
class Tools:
    """A request's tools, what it asks of them (`choice`: none, auto, required, or a tool's name) and
    whether several calls may come in one answer."""

    specs: tuple[ToolSpec, ...]
    choice: str = "auto"
    parallel: bool = True

    @classmethod
    def from_request(cls, tools: object, tool_choice: object = None, parallel_tool_calls: object = None) -> Tools:
        """Validate the request fields `tools`, `tool_choice` and `parallel_tool_calls`; RequestError names
        the field."""
        if not isinstance(tools, list):
            raise RequestError(f"tools: must be a list of tool objects, got {json_kind(tools)}")
        specs = tuple(_tool(value, f"tools[{k}]") for k, value in enumerate(tools))
        seen: set[str] = set()
        for k, spec in enumerate(specs):
            if spec.name in seen:
                raise RequestError(f"tools[{k}].function.name: {spec.name!r} names two tools; names must be unique")
            seen.add(spec.name)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise RequestError(f"parallel_tool_calls: must be a boolean, got {json_kind(parallel_tool_calls)}")
        choice = _choice(tool_choice, seen)
        return cls(specs, choice, True if parallel_tool_calls is None else parallel_tool_calls)

    @property
    def names(self) -> frozenset[str]:
        """The tools' names."""
        return frozenset(spec.name for spec in self.specs)

    def allowed(self) -> tuple[ToolSpec, ...]:
        """The tools a call may name: one when `choice` names it, all otherwise."""
        return tuple(s for s in self.specs if s.name == self.choice) or self.specs

    def as_template_json(self) -> list[dict[str, Any]]:
        """The `tools` a chat template sees."""
        return [spec.as_template_json() for spec in self.specs]


def _tool(value: object, where: str) -> ToolSpec:
    """One entry of `tools`."""
    if not isinstance(value, Mapping):
        raise RequestError(f"{where}: must be an object like {{'type': 'function', 'function': {{...}}}}, "
                           f"got {json_kind(value)}")
    if value.get("type") != "function":
        raise RequestError(f"{where}.type: {value.get('type')!r} is not supported; expected 'function'")
    extra = sorted(set(value) - {"type", "function"})
    if extra:
        raise RequestError(f"{where}.{extra[0]}: unknown field of a tool; expected 'type' and 'function'")
    function = value.get("function")
    if not isinstance(function, Mapping):
        raise RequestError(f"{where}.function: must be an object with 'name', got {json_kind(function)}")
    extra = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if extra:
        raise RequestError(f"{where}.function.{extra[0]}: unknown field; expected 'name', 'description', "
                           "'parameters' or 'strict'")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        shown = repr(name) if isinstance(name, str) else json_kind(name)
        raise RequestError(f"{where}.function.name: {shown} must be 1 to 64 letters, digits, '_' or '-'")
    description = function.get("description", "")
    if not isinstance(description, str):
        raise RequestError(f"{where}.function.description: must be a string, got {json_kind(description)}")
    strict = function.get("strict", False)
    if not isinstance(strict, bool) and strict is not None:
        raise RequestError(f"{where}.function.strict: must be a boolean, got {json_kind(strict)}")
    # As llama-server: absent, null or {} parameters take no arguments (common_chat_tool_parameters).
    parameters = function.get("parameters")
    if parameters is None or parameters == {}:
        parameters = {"type": "object", "properties": {}}
    _check_schema(parameters, f"{where}.function.parameters")
    return ToolSpec(name, description, parameters, bool(strict))


def _check_schema(schema: object, where: str) -> None:
    """RequestError unless `schema` is a JSON schema object (Draft 2020-12's meta-schema when `jsonschema`
    is installed)."""
    if not isinstance(schema, Mapping):
        raise RequestError(f"{where}: must be a JSON schema object, got {json_kind(schema)}")
    try:
        import jsonschema
    except ImportError:  # an optional check: the grammar compiler refuses what it cannot use anyway
        return
    validator = jsonschema.Draft202012Validator
    error = jsonschema.exceptions.best_match(validator(validator.META_SCHEMA).iter_errors(schema))
    if error is not None:
        at = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise RequestError(f"{where}{at}: not a valid JSON schema: {error.message}")


def _choice(value: object, names: set[str]) -> str:
    """`tool_choice`: one of CHOICES, or the name of the one tool the answer must call."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value not in CHOICES:
            raise RequestError(f"tool_choice: {value!r} is not supported; expected one of "
                               f"{', '.join(map(repr, CHOICES))} or "
                               "{'type': 'function', 'function': {'name': ...}}")
        return value
    if not isinstance(value, Mapping) or value.get("type") != "function":
        raise RequestError(f"tool_choice: must be a string or {{'type': 'function', 'function': {{'name': ...}}}}, "
                           f"got {json_kind(value)}")
    function = value.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise RequestError(f"tool_choice.function.name: must be a string, got {json_kind(name)}")
    if name not in names:
        known = ", ".join(sorted(names)) or "none"
        raise RequestError(f"tool_choice.function.name: {name!r} is not one of the tools (known: {known})")
    return name


@attrs.frozen
class ToolCall:
    """One call the model made: its id, the tool's name and the arguments as compact JSON text."""

    id: str
    name: str
    arguments: str

    def as_json(self) -> dict[str, Any]:
        """The call as an OpenAI message's `tool_calls` item."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@attrs.frozen
class ParsedAnswer:
    """A model's answer split into its text and its calls (none when the text holds no valid call)."""

    content: str
    calls: tuple[ToolCall, ...] = ()


class CallIds:
    """Ids for calls: a prefix and random alphanumerics, or, for tests, drawn from a seeded generator."""

    def __init__(self, *, prefix: str = CALL_ID_PREFIX, length: int = CALL_ID_LENGTH, seed: int | None = None) -> None:
        """Ids of `prefix` and `length` alphanumerics; `seed` makes them repeatable."""
        import random

        self._prefix = prefix
        self._length = length
        rng = random.Random(seed) if seed is not None else None
        self._choice: Callable[[str], str] = rng.choice if rng is not None else secrets.choice

    def next(self) -> str:
        """A new id."""
        return self._prefix + "".join(self._choice(_ALPHANUMERIC) for _ in range(self._length))


# JSON tokens; a string or literal cut short by the end of the text is matched by the partial forms.
_TOKEN = re.compile(r"""
    (?P<ws>[ \t\n\r]+)
  | (?P<punct>[{}\[\]:,])
  | (?P<string>"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*")
  | (?P<number>-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)
  | (?P<literal>true|false|null)
""", re.VERBOSE)
_PARTIAL_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z')
_PARTIAL_OTHER = re.compile(r"(?:[0-9.eE+-]+|t(?:r(?:ue?)?)?|f(?:a(?:l(?:se?)?)?)?|n(?:u(?:ll?)?)?)\Z")
_HIGH_SURROGATE_END = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}\Z")

Path = tuple[str | int, ...]


@attrs.frozen
class JsonScan:
    """What a JSON value read so far holds: `captured`, the compact text (a prefix of it while it is
    incomplete) of each value `capture` asked for, by label, in order of appearance; `done`, the labels
    whose value is complete; `end`, where the whole value ends (None while incomplete); `error`, whether
    the text is not the start of a JSON value."""

    captured: dict[str, str]
    done: frozenset[str]
    end: int | None
    error: bool


def scan_json(text: str, start: int, capture: Callable[[Path], str | None]) -> JsonScan:
    """Read the JSON value at `text[start:]` (whitespace before it skipped), possibly cut short; `capture`
    labels the paths (keys and indices from the root) whose values are wanted."""
    reader = _Reader(capture)
    pos = start
    end: int | None = None
    while pos < len(text) and end is None:
        match = _TOKEN.match(text, pos)
        if match is None or (match.lastgroup in ("number", "literal") and _PARTIAL_OTHER.match(text, pos)):
            # A number or literal at the very end may go on; a token that cannot start here is an error.
            rest = text[pos:]
            partial = _PARTIAL_STRING.match(rest) or _PARTIAL_OTHER.match(rest)
            if partial is None or not reader.can_start_value():
                reader.error = True
            elif rest.startswith('"'):
                reader.partial_string(rest)
            break
        reader.token(match.lastgroup or "", match.group())
        pos = match.end()
        if reader.error:
            break
        if reader.finished:
            end = pos
    return JsonScan(reader.captured, frozenset(reader.done), None if reader.error else end, reader.error)


class _Reader:
    """The state of scan_json: a stack of open containers, what comes next, the captures."""

    def __init__(self, capture: Callable[[Path], str | None]) -> None:
        """An empty reader expecting a value."""
        self._capture = capture
        self.captured: dict[str, str] = {}
        self.done: set[str] = set()
        self.finished = False
        self.error = False
        # Open containers: ("{" or "[", the path of the container, the next key or index).
        self._stack: list[list[Any]] = []
        self._expect = "value"  # value, key, colon, comma (or close), key_or_close, value_or_close
        self._active: list[tuple[str, int]] = []  # (label, depth of its value) being captured

    def can_start_value(self) -> bool:
        """Whether a value may begin here."""
        return self._expect in ("value", "value_or_close", "key", "key_or_close")

    def _path(self) -> Path:
        return tuple(frame[2] for frame in self._stack)

    def _write(self, text: str) -> None:
        for label, _ in self._active:
            self.captured[label] += text

    def _begin_value(self) -> None:
        label = self._capture(self._path())
        if label is not None and label not in self.captured:
            self.captured[label] = ""
            self._active.append((label, len(self._stack)))

    def _end_value(self) -> None:
        while self._active and self._active[-1][1] == len(self._stack):
            self.done.add(self._active.pop()[0])
        if not self._stack:
            self.finished = True
        else:
            self._expect = "comma"

    def partial_string(self, rest: str) -> None:
        """A string cut short at the end of the text: its decoded part, up to the last whole character."""
        if self._expect not in ("value", "value_or_close"):
            return  # a key: nothing is written before it is whole
        body = rest[1:]
        body = re.sub(r"\\(u[0-9a-fA-F]{0,3})?\Z", "", body)
        body = _HIGH_SURROGATE_END.sub("", body)  # its low half decides the character
        self._begin_value()
        self._write('"' + json.dumps(json.loads('"' + body + '"'), ensure_ascii=False)[1:-1])

    def token(self, kind: str, raw: str) -> None:
        """One whole token."""
        if kind == "ws":
            return
        expect = self._expect
        if kind == "punct" and raw in "}]":
            opened = "{" if raw == "}" else "["
            closable = "key_or_close" if opened == "{" else "value_or_close"
            if not self._stack or self._stack[-1][0] != opened or expect not in (closable, "comma"):
                self.error = True
                return
            self._stack.pop()
            self._write(raw)
            self._end_value()
        elif expect in ("key", "key_or_close"):
            if kind != "string":
                self.error = True
                return
            self._stack[-1][2] = json.loads(raw)
            self._write(_compact(kind, raw))
            self._expect = "colon"
        elif expect == "colon":
            self.error = raw != ":"
            self._write(":")
            self._expect = "value"
        elif expect == "comma":
            if raw != ",":
                self.error = True
                return
            self._write(",")
            frame = self._stack[-1]
            if frame[0] == "[":
                frame[2] += 1
            self._expect = "key" if frame[0] == "{" else "value"
        else:
            self._value_token(kind, raw)

    def _value_token(self, kind: str, raw: str) -> None:
        if kind == "punct" and raw in "{[":
            self._begin_value()
            self._write(raw)
            self._stack.append([raw, self._path(), 0 if raw == "[" else ""])
            self._expect = "key_or_close" if raw == "{" else "value_or_close"
        elif kind in ("string", "number", "literal"):
            self._begin_value()
            self._write(_compact(kind, raw))
            self._end_value()
        else:
            self.error = True


def _compact(kind: str, raw: str) -> str:
    """A whole token as the compact JSON of its value writes it."""
    if kind == "string":
        return json.dumps(json.loads(raw), ensure_ascii=False)
    if kind == "number":
        value = json.loads(raw)
        return raw if isinstance(value, float) and value in (float("inf"), float("-inf")) else json.dumps(value)
    return raw


def compact_json(value: Any) -> str:
    """A decoded JSON value written compact, as scan_json writes it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


