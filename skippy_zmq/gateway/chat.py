"""Chat prompts: OpenAI-style messages rendered with the model's chat template, then tokenized.

The template is the GGUF's `tokenizer.chat_template`, run in Jinja's immutable sandbox with the
settings chat templates are written for (trim_blocks, lstrip_blocks, loop controls) and rendered as
llama-server's `--jinja` mode renders it: the same context, the same changes to the messages, its
traits probed as llama.cpp probes them (docs/PROTOCOL.md §9.2). A file without one gets its
architecture's built-in turn format, itself a template (the `chat_fallback` of its row in
model/arch.py).

Special tokens come from the template only. Each message's content (and name) reaches the
template as a marker string; the rendered text is split at the markers, the template's text is
tokenized with special-token parsing and the contents without it (`Tokenizer.encode_segments`,
docs/PROTOCOL.md §7). So `<start_of_turn>` written by the template is one control token, while
a user who types `<end_of_turn>` gets plain-text tokens. User-defined tokens and SPM merges see
the joined text as one string, so for contents free of special-token text the ids equal
llama.cpp's tokenization of the whole rendered prompt with `parse_special` on, as its server does.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import attrs
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
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
    """One validated chat message: role in ROLES, content as one string, optional name; `parts`, the texts
    of a content given as a list of text parts (`content` is then their join with newlines, as
    llama-server joins them)."""

    role: str = attrs.field()
    content: str
    name: str | None = None
    parts: tuple[str, ...] | None = None

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
        content = value.get("content")
        parts = _parts_of(content, where) if isinstance(content, list) else None
        text = "\n".join(parts) if parts is not None else _content_of(content, role, where)
        return cls(role, text, name, parts)


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
            self._template = _compile(_patched(source))
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{origin}: {_describe(exc)}") from None
        self._traits = _traits(_patched(source))
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

    def render_text(self, messages: Sequence[Mapping[str, Any] | ChatMessage], *,
                    now: datetime.datetime | None = None) -> str:
        """The prompt text as llama-server's `--jinja` mode renders it (a leading BOS text the vocab adds
        anyway is dropped); `now` (default: the local time) for the dates templates write."""
        parsed = self._prepare(parse_messages(messages))
        return self._render(parsed, [(m.content, m.parts, m.name) for m in parsed], now or datetime.datetime.now())

    def render_ids(self, messages: Sequence[Mapping[str, Any] | ChatMessage]) -> list[int]:
        """Prompt token ids: template text with special tokens parsed, contents as plain text."""
        return list(self.render(messages).ids)

    def render(self, messages: Sequence[Mapping[str, Any] | ChatMessage], *,
               now: datetime.datetime | None = None) -> ChatPrompt:
        """Text and ids of the prompt in one rendering pass."""
        parsed = self._prepare(parse_messages(messages))
        now = now or datetime.datetime.now()
        text = self._render(parsed, [(m.content, m.parts, m.name) for m in parsed], now)
        texts = [*(m.content for m in parsed), *(p for m in parsed for p in m.parts or ()),
                 *(m.name or "" for m in parsed)]
        markers = _Markers([self.source, *texts])
        marked = self._render(parsed, [
            (markers.wrap(m.content), None if m.parts is None else tuple(markers.wrap(p) for p in m.parts),
             _maybe(markers, m.name)) for m in parsed], now)
        segments = markers.segments(marked)
        tokenizer = self._tokenizer
        if "".join(piece for piece, _ in segments) == text:
            ids = tokenizer.encode_segments(segments)
        else:
            # The template changed a content beyond trimming it, so the contents cannot be
            # located: parse the whole text, which is safe only if no content holds special text.
            _refuse_special_text(parsed, tokenizer)
            ids = tokenizer.encode(text, parse_special=True)
        # As llama-server: the vocab's BOS (and EOS) around the text, whose own were dropped (_render).
        return ChatPrompt(text, tuple(ids))

    def _prepare(self, messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
        """llama-server's changes to the messages before a template sees them (common/chat.cpp's
        workarounds): a system message merged into the next one where the template ignores the system
        role, every content trimmed for StepFun's template."""
        traits = self._traits
        if traits.trim_contents:
            messages = tuple(attrs.evolve(m, content=m.content.strip(),
                                          parts=None if m.parts is None else tuple(p.strip() for p in m.parts))
                             for m in messages)
        if not traits.system_role and messages[0].role == "system":
            if len(messages) == 1:
                return ()
            first, second = messages[0], messages[1]
            merged = attrs.evolve(second, content=first.content + "\n" + second.content, parts=None)
            messages = (merged, *messages[2:])
        return messages

    def _render(self, messages: Sequence[ChatMessage],
                contents: Sequence[tuple[str, tuple[str, ...] | None, str | None]], now: datetime.datetime) -> str:
        """Run the template over `messages` with their (content, parts, name) replaced by `contents`,
        in the context llama-server's `--jinja` mode gives (common_chat_template_direct_apply)."""
        items = [self._item(message, *fields) for message, fields in zip(messages, contents, strict=True)]
        context = {
            "messages": items,
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "add_generation_prompt": True,
            "enable_thinking": self._traits.enable_thinking,
            "datetime": now.strftime("%b %d %Y"),
            "date_string": now.strftime("%d %b %Y"),
            "strftime_now": now.strftime,
            **_PRESERVE_REASONING,
        }
        try:
            text = self._template.render(context)
        except SkippyError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{self.origin}: {_describe(exc)}") from None
        except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError, RecursionError) as exc:
            # Untrusted template code failing in Python itself, e.g. `'a' + 1`.
            raise ChatTemplateError(f"{self.origin}: the template failed: {type(exc).__name__}: {exc}") from None
        # The vocab adds BOS (EOS) itself: llama-server drops the template's from the text's ends.
        if self._tokenizer.add_bos and self._bos_token and text.startswith(self._bos_token):
            text = text[len(self._bos_token):]
        if self._tokenizer.add_eos and self._eos_token and text.endswith(self._eos_token):
            text = text[: -len(self._eos_token)]
        return text

    def _item(self, message: ChatMessage, content: str, parts: tuple[str, ...] | None,
              name: str | None) -> dict[str, Any]:
        """One message as the template sees it: a content string, or text parts where the template
        takes only those (or takes both and was given parts), Ministral 3's blocks for its system and
        assistant turns."""
        traits = self._traits
        value: Any = content
        if traits.typed_only or (parts is not None and not traits.string_only):
            value = [{"type": "text", "text": part} for part in (parts if parts is not None else (content,))]
        if traits.ministral_blocks and message.role in ("system", "assistant") and isinstance(value, str):
            value = [{"type": "text", "text": value}]
        item: dict[str, Any] = {"role": message.role, "content": value}
        if name is not None:
            item["name"] = name
        return item


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
    """A message content that is not a list of parts: a string (null for an assistant turn)."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""  # an assistant turn that only called tools; tool calls are refused above
    raise RequestError(f"{where}.content: must be a string or a list of text parts, got {_kind(content)}")


def _parts_of(content: list[object], where: str) -> tuple[str, ...]:
    """The texts of a content given as a list of text parts."""
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
    return tuple(texts)


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
    if isinstance(value, _ProbeList):
        value = value[:]  # a probe's parts written as JSON are not parts used as a list (llama.cpp's view)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


# Two template lines llama-server replaces before compiling (common_chat_templates_init): checks that
# refuse some assistant contents in gpt-oss's and Mistral's templates.
_SOURCE_PATCHES = (
    ("<|channel|>", "in message.content or",
     '{%- if "<|channel|>analysis<|message|>" in message.content or '
     '"<|channel|>final<|message|>" in message.content %}'),
    ("[TOOL_CALLS]", "if (message['content'] is none or",
     "{%- if (message['content'] is none or message['content'] == '' or message['content']|length == 0) and "
     "(message['tool_calls'] is not defined or message['tool_calls'] is none or message['tool_calls']|length == 0) %}"),
)
_STRING_MARKER = "STRING_MARKER"
_THINKING_MARKER = "THINKING_MARKER"
_TAIL_ANCHOR = 64  # characters of a prompt's end looked for in the other (chat-diff-analyzer.cpp)
# llama-server's default template arguments: reasoning kept in history (--reasoning-preserve, on by
# default) under every name templates read it by (jinja/caps.cpp, caps_apply_preserve_reasoning).
_PRESERVE_REASONING = {"preserve_reasoning": True, "preserve_thinking": True, "clear_thinking": False,
                       "truncate_history_thinking": False, "drop_thinking": False}


def _patched(source: str) -> str:
    """`source` with the lines llama-server patches replaced by `{%- if false %}`, as it does."""
    for needle, hint, line in _SOURCE_PATCHES:
        if needle in source and hint in source:
            source = source.replace(line, "{%- if false %}")
    return source


@attrs.frozen
class _Traits:
    """What llama-server finds out about a template before rendering (jinja/caps.cpp, chat.cpp)."""

    system_role: bool  # the template reads a system message's content
    string_only: bool  # contents as strings only: parts are joined
    typed_only: bool  # contents as lists of parts only: a string becomes one text part
    trim_contents: bool  # StepFun's template: every content trimmed
    ministral_blocks: bool  # Ministral 3's template: system and assistant contents as blocks
    enable_thinking: bool


class _ProbeText(str):
    """A probe's content string: notes whether the template used it as a list or tested its type."""

    as_array = False
    tested_string = False

    def __iter__(self) -> Any:
        """Iterated as a list of parts."""
        self.as_array = True
        return super().__iter__()

    def __getitem__(self, key: Any) -> str:
        """Indexed by a number, as a list of parts."""
        if isinstance(key, int):
            self.as_array = True
        return super().__getitem__(key)


class _ProbeList(list[Any]):
    """A probe's empty list of parts: notes whether the template used it as one."""

    as_array = False

    def __iter__(self) -> Any:
        """Iterated as a list of parts."""
        self.as_array = True
        return super().__iter__()


class _ProbeMessage(dict[str, Any]):
    """A probe's message: notes the keys the template read."""

    def __init__(self, **fields: Any) -> None:
        """The message's fields."""
        super().__init__(fields)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        """A field read."""
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        """A field read with a default."""
        self.read.add(key)
        return super().get(key, default)


def _probe(template: jinja2.Template, messages: list[_ProbeMessage], **more: Any) -> str | None:
    """The probe's rendering in llama.cpp's capability context, None if the template fails."""
    context = {"messages": messages, "tools": [], "bos_token": "", "eos_token": "", "add_generation_prompt": True,
               **more}
    try:
        return template.render(context)
    except Exception:  # noqa: BLE001 - any failure of untrusted template code just answers the probe
        return None


@functools.lru_cache(maxsize=16)
def _traits(source: str) -> _Traits:
    """Probe a (patched) template the way llama.cpp's caps_get does, for the traits rendering needs."""
    template = _compile(source)
    text = _ProbeText(_STRING_MARKER)
    rendered = _probe(template, [_ProbeMessage(role="user", content=text)])
    typed = text.as_array
    string = rendered is not None and not (typed and _STRING_MARKER not in rendered)
    if text.tested_string and not typed:
        parts = _ProbeList()
        typed = _probe(template, [_ProbeMessage(role="user", content=parts)]) is not None and parts.as_array
    system = _ProbeMessage(role="system", content="System message")
    _probe(template, [system, _ProbeMessage(role="user", content="User message")])
    return _Traits(
        system_role="content" in system.read,
        string_only=string and not typed,
        typed_only=typed and not string,
        trim_contents="You have access to the following functions in JSONSchema format" in source,
        ministral_blocks=all(tag in source for tag in ("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]"))
        and "[CALL_ID]" not in source,
        # Gemma 4's template gets llama.cpp's own Gemma 4 parser, which always thinks (parsers/gemma4.cpp).
        enable_thinking="'<|tool_call>call:'" in source or _thinks(template),
    )


def _thinks(template: jinja2.Template) -> bool:
    """Whether llama-server finds the template able to think, and so renders it with enable_thinking:
    an assistant turn's reasoning appears in the prompt, or turning thinking on or off adds text after
    the end of the other prompt (chat-diff-analyzer.cpp's reasoning analysis, without its marker rules)."""
    user = _ProbeMessage(role="user", content="User message")
    history = [user, _ProbeMessage(role="assistant", content="Assistant message", reasoning_content=_THINKING_MARKER)]
    shown = _probe(template, history, add_generation_prompt=False, enable_thinking=True, **_PRESERVE_REASONING)
    if shown is not None and _THINKING_MARKER in shown:
        return True
    off = _probe(template, [user], enable_thinking=False, **_PRESERVE_REASONING)
    on = _probe(template, [user], enable_thinking=True, **_PRESERVE_REASONING)
    if off is None or on is None:
        return False
    for base, extended in ((on, off), (off, on)):
        anchor = base[-_TAIL_ANCHOR:]
        at = extended.rfind(anchor)
        if at >= 0 and extended[at + len(anchor):].strip():
            return True
    return False


def _is_string(value: object) -> bool:
    """Jinja's `string` test, noting a probe content tested with it."""
    if isinstance(value, _ProbeText):
        value.tested_string = True
    return isinstance(value, str)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' marker of assistant text): its body as is."""

    tags = {"generation"}  # noqa: RUF012 - jinja2.ext.Extension declares a set

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        """The body between the tags."""
        next(parser.stream)
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


def _describe(exc: jinja2.TemplateError) -> str:
    """What is wrong with a template, for ChatTemplateError."""
    if isinstance(exc, jinja2.TemplateSyntaxError):
        return f"syntax error on line {exc.lineno}: {exc.message}"
    if isinstance(exc, jinja2.UndefinedError):
        return f"undefined value: {exc.message}"
    if isinstance(exc, jinja2.exceptions.SecurityError):
        return f"forbidden by the sandbox: {exc.message}"
    return f"{type(exc).__name__}: {exc.message}"


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with llama.cpp's one arithmetic leniency: `+` of a string and a null or
    undefined value is the string (jinja/runtime.cpp, workaround_concat_null_with_str)."""

    intercepted_binops = frozenset({"+"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        """`left + right`, a null or undefined side next to a string counting as empty."""
        if isinstance(left, str) and (right is None or isinstance(right, jinja2.Undefined)):
            return left
        if isinstance(right, str) and (left is None or isinstance(left, jinja2.Undefined)):
            return right
        return super().call_binop(context, operator, left, right)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    """The one sandbox all chat templates compile in (settings chat templates are written for)."""
    env = _ChatSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag], autoescape=False
    )
    env.filters["tojson"] = _tojson
    env.tests["string"] = _is_string
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """Compile a template once per source text (a syntax error is raised again on every call)."""
    return _environment().from_string(source)
