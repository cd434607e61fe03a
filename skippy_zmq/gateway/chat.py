"""Chat prompts: OpenAI-style messages rendered with the model's chat template, then tokenized.

The template is the GGUF's `tokenizer.chat_template`, run in Jinja's immutable sandbox with the
settings chat templates are written for (trim_blocks, lstrip_blocks, loop controls). A file
without one gets its architecture's built-in turn format, itself a template (the `chat_fallback` of
its row in model/arch.py).

Special tokens come from the template only. Each message's content (and name) reaches the
template as a marker string; the rendered text is split at the markers, the template's text is
tokenized with special-token parsing and the contents without it (`Tokenizer.encode_segments`,
docs/PROTOCOL.md §7). So `<start_of_turn>` written by the template is one control token, while
a user who types `<end_of_turn>` gets plain-text tokens. User-defined tokens and SPM merges see
the joined text as one string, so for contents free of special-token text the ids equal
llama.cpp's tokenization of the whole rendered prompt with `parse_special` on, as its server does.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import attrs
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from skippy_zmq.errors import ChatTemplateError, RequestError, SkippyError
from skippy_zmq.gateway.request_json import OversizedInteger
from skippy_zmq.model.arch import ARCHITECTURES
from skippy_zmq.model.gguf_file import GGUFHeader, GGUFKey, read_header
from skippy_zmq.tokens.tokenizer import Tokenizer

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
ROLES = ("system", "user", "assistant")
_ROLE_ALIASES = {"developer": "system"}
# OpenAI message fields accepted at their neutral values only.
_NEUTRAL_FIELDS: dict[str, tuple[object, ...]] = {
    "tool_calls": (None, []),
    "function_call": (None,),
    "refusal": (None,),
    "audio": (None,),
}



@attrs.frozen
class ChatMessage:
    """One validated chat message: role in ROLES, content as one string, optional name."""

    role: str = attrs.field()
    content: str
    name: str | None = None

    @role.validator
    def _check_role(self, _attribute: attrs.Attribute[str], value: str) -> None:
        if value not in ROLES:
            raise RequestError(f"message role {value!r} is not supported; expected one of {', '.join(ROLES)}")

    @classmethod
    def from_json(cls, value: object, index: int) -> ChatMessage:
        """Validate one OpenAI message object; RequestError names `messages[index]` and the field."""
        where = f"messages[{index}]"
        if not isinstance(value, Mapping):
            raise RequestError(f"{where}: must be an object with 'role' and 'content', got {_kind(value)}")
        for key, value_of_key in value.items():
            if key in ("role", "content", "name"):
                continue
            if key not in _NEUTRAL_FIELDS:
                raise RequestError(f"{where}.{key}: unknown message field; expected 'role', 'content' or 'name'")
            if value_of_key not in _NEUTRAL_FIELDS[key]:
                raise RequestError(f"{where}.{key}: is not supported; only null is accepted")
        role = value.get("role")
        if not isinstance(role, str) or _ROLE_ALIASES.get(role, role) not in ROLES:
            shown = "missing" if role is None else f"{role!r} is not supported"
            raise RequestError(f"{where}.role: {shown}; expected one of {', '.join(map(repr, ROLES))} (or 'developer')")
        role = _ROLE_ALIASES.get(role, role)
        name = value.get("name")
        if name is not None and not isinstance(name, str):
            raise RequestError(f"{where}.name: must be a string, got {_kind(name)}")
        return cls(role, _content_of(value.get("content"), role, where), name)


def parse_messages(messages: object) -> tuple[ChatMessage, ...]:
    """Validate an OpenAI `messages` list (ChatMessage items pass as they are)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise RequestError(f"messages: must be a non-empty list of message objects, got {_kind(messages)}")
    return tuple(m if isinstance(m, ChatMessage) else ChatMessage.from_json(m, i) for i, m in enumerate(messages))


@attrs.frozen
class ChatPrompt:
    """A rendered chat prompt: its text and its token ids (BOS included)."""

    text: str
    ids: tuple[int, ...]


class ChatTemplate:
    """A compiled chat template bound to a tokenizer; read-only and safe to share between threads."""

    def __init__(self, source: str, tokenizer: Tokenizer, *, origin: str, is_fallback: bool = False) -> None:
        """Compile `source` (cached per source text); use the named constructors instead."""
        self.source = source
        self.origin = origin
        self.is_fallback = is_fallback
        self._tokenizer = tokenizer
        try:
            self._template = _compile(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{origin}: {_describe(exc)}") from None
        self._bos_token = "" if tokenizer.bos_id is None else tokenizer.token_text(tokenizer.bos_id)
        self._eos_token = "" if tokenizer.eos_id is None else tokenizer.token_text(tokenizer.eos_id)

    @classmethod
    def from_source(cls, source: str, tokenizer: Tokenizer, *, origin: str = "chat template") -> ChatTemplate:
        """A template from explicit Jinja source."""
        return cls(source, tokenizer, origin=origin)

    @classmethod
    def for_family(cls, arch: str, tokenizer: Tokenizer) -> ChatTemplate:
        """The built-in turn format of an architecture (general.architecture)."""
        spec = ARCHITECTURES.get(arch)
        if spec is None:
            raise ChatTemplateError(
                f"no built-in turn format for architecture {arch!r}; known: {', '.join(sorted(ARCHITECTURES))}"
            )
        return cls(spec.chat_fallback, tokenizer, origin=f"built-in {arch} turn format", is_fallback=True)

    @classmethod
    def from_header(cls, header: GGUFHeader, tokenizer: Tokenizer) -> ChatTemplate:
        """The file's tokenizer.chat_template, or its family's turn format when it has none."""
        source = header.string(CHAT_TEMPLATE_KEY, None)
        if source is not None:
            return cls(source, tokenizer, origin=f"{header.source}: {CHAT_TEMPLATE_KEY}")
        arch = header.string(GGUFKey.ARCHITECTURE, "")
        try:
            return cls.for_family(arch, tokenizer)
        except ChatTemplateError as exc:
            raise ChatTemplateError(f"{header.source}: has no {CHAT_TEMPLATE_KEY} and {exc}") from None

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], tokenizer: Tokenizer) -> ChatTemplate:
        """from_header on the header of a GGUF file."""
        return cls.from_header(read_header(path), tokenizer)

    def render_text(self, messages: Sequence[Mapping[str, Any] | ChatMessage]) -> str:
        """The prompt text the template renders (with BOS text if the template writes it)."""
        parsed = parse_messages(messages)
        return self._render(parsed, [(m.content, m.name) for m in parsed])

    def render_ids(self, messages: Sequence[Mapping[str, Any] | ChatMessage]) -> list[int]:
        """Prompt token ids: template text with special tokens parsed, contents as plain text."""
        return list(self.render(messages).ids)

    def render(self, messages: Sequence[Mapping[str, Any] | ChatMessage]) -> ChatPrompt:
        """Text and ids of the prompt in one rendering pass."""
        parsed = parse_messages(messages)
        text = self._render(parsed, [(m.content, m.name) for m in parsed])
        markers = _Markers([self.source, *(m.content for m in parsed), *(m.name or "" for m in parsed)])
        marked = self._render(parsed, [(markers.wrap(m.content), _maybe(markers, m.name)) for m in parsed])
        segments = markers.segments(marked)
        tokenizer = self._tokenizer
        if "".join(piece for piece, _ in segments) == text:
            ids = tokenizer.encode_segments(segments, add_special=False)
        else:
            # The template changed a content beyond trimming it, so the contents cannot be
            # located: parse the whole text, which is safe only if no content holds special text.
            _refuse_special_text(parsed, tokenizer)
            ids = tokenizer.encode(text, add_special=False, parse_special=True)
        if tokenizer.add_bos and tokenizer.bos_id is not None and ids[:1] != [tokenizer.bos_id]:
            ids.insert(0, tokenizer.bos_id)  # once, unless the template wrote it (as llama.cpp's server)
        return ChatPrompt(text, tuple(ids))

    def _render(self, messages: Sequence[ChatMessage], contents: Sequence[tuple[str, str | None]]) -> str:
        """Run the template over `messages` with their (content, name) replaced by `contents`."""
        items = []
        for message, (content, name) in zip(messages, contents, strict=True):
            item = {"role": message.role, "content": content}
            if name is not None:
                item["name"] = name
            items.append(item)
        context = {
            "messages": items,
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "add_generation_prompt": True,
        }
        try:
            return self._template.render(context)
        except SkippyError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{self.origin}: {_describe(exc)}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError, RecursionError) as exc:
            # Untrusted template code failing in Python itself, e.g. `'a' + 1`.
            raise ChatTemplateError(f"{self.origin}: the template failed: {type(exc).__name__}: {exc}") from None


class _Content(str):
    """A content as the template sees it: the text is a marker; trimming yields the trimmed content's marker."""

    _markers: _Markers
    _value: str

    def __new__(cls, markers: _Markers, value: str) -> _Content:
        """A new marker for `value`, registered with `markers`."""
        self = super().__new__(cls, markers.marker(value))
        self._markers = markers
        self._value = value
        return self

    def __bool__(self) -> bool:
        """Truth of the content (`{% if message.content %}`), not of the marker."""
        return bool(self._value)

    def __len__(self) -> int:
        """Length of the content (Jinja's `length`), not of the marker."""
        return len(self._value)

    def strip(self, chars: str | None = None, /) -> str:
        """The marker of the stripped content (Jinja's `trim` calls this)."""
        return _Content(self._markers, self._value.strip(chars))

    def lstrip(self, chars: str | None = None, /) -> str:
        """The marker of the content stripped on the left."""
        return _Content(self._markers, self._value.lstrip(chars))

    def rstrip(self, chars: str | None = None, /) -> str:
        """The marker of the content stripped on the right."""
        return _Content(self._markers, self._value.rstrip(chars))


class _Markers:
    """Marker strings for one rendering: private-use delimiters around a random nonce and an index."""

    def __init__(self, avoid: Sequence[str]) -> None:
        """Pick a nonce that occurs in none of `avoid` (the template source and every content)."""
        while True:
            self._open = f"\ue000{secrets.token_hex(8)}:"
            if not any(self._open in text for text in avoid):
                break
        self._pattern = re.compile(re.escape(self._open) + "([0-9]+)\ue001")
        self._values: list[str] = []

    def marker(self, value: str) -> str:
        """The marker text standing for `value`."""
        self._values.append(value)
        return f"{self._open}{len(self._values) - 1}\ue001"

    def wrap(self, value: str) -> _Content:
        """A template-facing content for `value`."""
        return _Content(self, value)

    def segments(self, marked: str) -> list[tuple[str, bool]]:
        """`(text, parse_special)` pieces of a marked rendering: template text True, contents False."""
        parts = self._pattern.split(marked)
        # re.split alternates: template text, captured index, template text, ...
        return [(self._values[int(part)], False) if k % 2 else (part, True) for k, part in enumerate(parts)]


def _maybe(markers: _Markers, value: str | None) -> str | None:
    return None if value is None else markers.wrap(value)


def _refuse_special_text(messages: Sequence[ChatMessage], tokenizer: Tokenizer) -> None:
    """RequestError if a content or name holds special-token text the template would let through."""
    for index, message in enumerate(messages):
        for field, text in (("content", message.content), ("name", message.name or "")):
            found = tokenizer.special_text_in(text)
            if found is not None:
                raise RequestError(
                    f"messages[{index}].{field}: contains the special-token text {found!r}, which this chat "
                    "template cannot keep as plain text"
                )


def _content_of(content: object, role: str, where: str) -> str:
    """A message content as one string: a string, or the joined texts of text parts."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""  # an assistant turn that only called tools; tool calls are refused above
    if not isinstance(content, list):
        raise RequestError(f"{where}.content: must be a string or a list of text parts, got {_kind(content)}")
    texts = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        if not isinstance(part, Mapping):
            raise RequestError(f"{at}: must be an object like {{'type': 'text', 'text': ...}}, got {_kind(part)}")
        kind = part.get("type")
        if kind != "text":
            raise RequestError(f"{at}.type: {kind!r} is not supported; only 'text' parts are")
        extra = sorted(set(part) - {"type", "text"})
        if extra:
            raise RequestError(f"{at}.{extra[0]}: unknown field of a text part; expected 'type' and 'text'")
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(f"{at}.text: must be a string, got {_kind(text)}")
        texts.append(text)
    return "".join(texts)


def _kind(value: object) -> str:
    """A JSON-ish name for the type of `value`, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, OversizedInteger):
        return repr(value)
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "an empty list" if not value else "a list"
    return type(value).__name__


def _raise_exception(message: object) -> NoReturn:
    """`raise_exception(...)` for templates: the template refuses these messages."""
    raise RequestError(f"messages: refused by the chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False) -> str:
    """`tojson` as chat templates expect it: plain JSON, no HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _describe(exc: jinja2.TemplateError) -> str:
    """What is wrong with a template, for ChatTemplateError."""
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return f"syntax error on line {exc.lineno}: {exc.message}"
    if isinstance(exc, jinja2.UndefinedError):
        return f"undefined value: {exc.message}"
    if isinstance(exc, jinja2.exceptions.SecurityError):
        return f"forbidden by the sandbox: {exc.message}"
    return f"{type(exc).__name__}: {exc.message}"


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    """The one sandbox all chat templates compile in (settings chat templates are written for)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], autoescape=False
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """Compile a template once per source text (a syntax error is raised again on every call)."""
    return _environment().from_string(source)
