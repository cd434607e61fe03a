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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

import attrs
import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment

from skippy_zmq.errors import ChatTemplateError, RequestError, SkippyError
from skippy_zmq.gateway.reasoning import (
    DEFAULT_THINKING,
    ReasoningFormat,
    ReasoningReader,
    Thinking,
    markers_of,
)
from skippy_zmq.gateway.request_json import json_kind
from skippy_zmq.gateway.tool_calls import ToolCall, Tools
from skippy_zmq.gateway.tool_formats import ToolFormat, detect_format
from skippy_zmq.model.arch import ARCHITECTURES
from skippy_zmq.model.gguf_file import GGUFHeader, GGUFKey, read_header
from skippy_zmq.tokens.tokenizer import Tokenizer

CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
ROLES = ("system", "user", "assistant", "tool")
_ROLE_ALIASES = {"developer": "system"}
# OpenAI message fields accepted at their neutral values only.
_MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
_NEUTRAL_FIELDS: dict[str, tuple[object, ...]] = {
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
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls (ids may be "")
    tool_call_id: str | None = None  # a tool turn's answer to that call
    reasoning_content: str | None = None  # an assistant turn's thought, for templates that show it

    @role.validator
    def _check_role(self, _attribute: attrs.Attribute[str], value: str) -> None:
        if value not in ROLES:
            raise RequestError(f"message role {value!r} is not supported; expected one of {', '.join(ROLES)}")

    @classmethod
    def from_json(cls, value: object, index: int) -> ChatMessage:
        """Validate one OpenAI message object; RequestError names `messages[index]` and the field."""
        where = f"messages[{index}]"
        if not isinstance(value, Mapping):
            raise RequestError(f"{where}: must be an object with 'role' and 'content', got {json_kind(value)}")
        for key, value_of_key in value.items():
            if key in _MESSAGE_FIELDS:
                continue
            if key not in _NEUTRAL_FIELDS:
                raise RequestError(f"{where}.{key}: unknown message field; expected one of "
                                   f"{', '.join(_MESSAGE_FIELDS)}")
            if value_of_key not in _NEUTRAL_FIELDS[key]:
                raise RequestError(f"{where}.{key}: is not supported; only null is accepted")
        role = value.get("role")
        if not isinstance(role, str) or _ROLE_ALIASES.get(role, role) not in ROLES:
            shown = "missing" if role is None else f"{role!r} is not supported"
            raise RequestError(f"{where}.role: {shown}; expected one of {', '.join(map(repr, ROLES))} (or 'developer')")
        role = _ROLE_ALIASES.get(role, role)
        name = value.get("name")
        if name is not None and not isinstance(name, str):
            raise RequestError(f"{where}.name: must be a string, got {json_kind(name)}")
        content = value.get("content")
        calls = _tool_calls_of(value.get("tool_calls"), role, where)
        call_id, thought = value.get("tool_call_id"), value.get("reasoning_content")
        for field, given in (("tool_call_id", call_id), ("reasoning_content", thought)):
            if given is not None and not isinstance(given, str):
                raise RequestError(f"{where}.{field}: must be a string, got {json_kind(given)}")
        parts = _parts_of(content, where) if isinstance(content, list) else None
        text = "\n".join(parts) if parts is not None else _content_of(content, role, where)
        return cls(role, text, name, parts, calls, call_id, thought)


def parse_messages(messages: object) -> tuple[ChatMessage, ...]:
    """Validate an OpenAI `messages` list (ChatMessage items pass as they are)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes) or not messages:
        raise RequestError(f"messages: must be a non-empty list of message objects, got {json_kind(messages)}")
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

    @staticmethod
    def check_source(source: str, *, origin: str) -> None:
        """ChatTemplateError naming `origin` unless `source` compiles (before any tokenizer is read)."""
        try:
            _compile(_patched(source))
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{origin}: {_describe(exc)}") from None

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

    @property
    def tool_format(self) -> ToolFormat:
        """The tool-call format of this template (generic for an architecture's built-in turn format)."""
        return detect_format(None if self.is_fallback else self.source)

    def thinks(self, thinking: Thinking = DEFAULT_THINKING) -> bool:
        """The `enable_thinking` the template gets: the request's, else as llama-server finds the template
        (able to think: on)."""
        return self._traits.enable_thinking if thinking.enable is None else thinking.enable

    def reasoning_reader(self, thinking: Thinking = DEFAULT_THINKING) -> ReasoningReader | None:
        """How answers are read for thought (None: the template writes no thought markers, or the
        request's reasoning format is `none`); the prompt ends inside a thought when the template opens
        one after the last turn with this `enable_thinking`."""
        markers = None if self.is_fallback else markers_of(self.source)
        if markers is None or thinking.format is ReasoningFormat.NONE:
            return None
        return ReasoningReader(markers, self._opens(markers.start, self.thinks(thinking)),
                               thinking.format is ReasoningFormat.DEEPSEEK_LEGACY)

    @functools.lru_cache(maxsize=4)  # noqa: B019 - templates live as long as the server
    def _opens(self, start: str, enable_thinking: bool) -> bool:
        user = ChatMessage("user", "Hello")
        try:
            prompt = self._render((user,), str, datetime.datetime.now(), None, True,
                                  Thinking(enable=enable_thinking))
        except SkippyError:
            return False
        return prompt.rstrip().endswith(start)

    def render_text(self, messages: Sequence[Mapping[str, Any] | ChatMessage], *, tools: Tools | None = None,
                    now: datetime.datetime | None = None, add_generation_prompt: bool = True,
                    continue_final: bool = False, thinking: Thinking = DEFAULT_THINKING) -> str:
        """The prompt text as llama-server's `--jinja` mode renders it (a leading BOS text the vocab adds
        anyway is dropped); `tools` as the template sees them; `now` (default: the local time) for the
        dates templates write; `continue_final` as `render`'s; `thinking`, the request's thought settings."""
        given = parse_messages(messages)
        parsed = self._prepare(given[:-1] if continue_final else given, tools)
        text = self._render(parsed, str, now or datetime.datetime.now(), tools, add_generation_prompt or continue_final,
                            thinking)
        return text + (_continued(given[-1]) if continue_final else "")

    def render_ids(self, messages: Sequence[Mapping[str, Any] | ChatMessage], *, tools: Tools | None = None,
                   add_generation_prompt: bool = True, continue_final: bool = False,
                   thinking: Thinking = DEFAULT_THINKING) -> list[int]:
        """Prompt token ids: template text with special tokens parsed, contents as plain text."""
        return list(self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                continue_final=continue_final, thinking=thinking).ids)

    def render(self, messages: Sequence[Mapping[str, Any] | ChatMessage], *, tools: Tools | None = None,
               now: datetime.datetime | None = None, add_generation_prompt: bool = True,
               continue_final: bool = False, thinking: Thinking = DEFAULT_THINKING) -> ChatPrompt:
        """Text and ids of the prompt in one rendering pass; `tools` (a request's Tools) as the template
        sees them, their texts, the calls' and the tool results' kept as plain text like contents. With
        `continue_final`, the answer continues the last message (llama-server's continue_final_message):
        the messages before it with the generation prompt, then its content as it is. `thinking`: the
        request's thought settings (enable_thinking and template variables)."""
        given = parse_messages(messages)
        final = given[-1] if continue_final else None
        parsed = self._prepare(given[:-1] if continue_final else given, tools)
        tail = "" if final is None else _continued(final)
        generation = add_generation_prompt or continue_final
        now = now or datetime.datetime.now()
        text = self._render(parsed, str, now, tools, generation, thinking) + tail
        shown = (*parsed, final) if final is not None else parsed
        avoid = [self.source, json.dumps(tools.as_template_json() if tools else [], ensure_ascii=False), tail,
                 *(m.content for m in shown), *(p for m in shown for p in m.parts or ()),
                 *(m.reasoning_content or "" for m in shown),
                 *(m.name or "" for m in shown), *(m.tool_call_id or "" for m in shown),
                 *(f"{c.id} {c.name} {c.arguments}" for m in shown for c in m.tool_calls)]
        _refuse_special_keys(shown, tools, self._tokenizer)
        found = self._tokenizer.special_text_in(json.dumps(thinking.context(), ensure_ascii=False))
        if found is not None:
            raise RequestError(f"chat_template_kwargs: contain the special-token text {found!r}, which the "
                               "template would read as control tokens")
        markers = ContentMarkers(avoid)
        marked = (self._render(parsed, markers.wrap, now, tools, generation, thinking)
                  + (markers.wrap(tail) if tail else ""))
        segments = markers.segments(marked)
        tokenizer = self._tokenizer
        if "".join(piece for piece, _ in segments) == text:
            ids = tokenizer.encode_segments(segments)
        else:
            # The template changed a content beyond trimming it, so the contents cannot be
            # located: parse the whole text, which is safe only if no content holds special text.
            _refuse_special_text(shown, tokenizer, tools)
            ids = tokenizer.encode(text, parse_special=True)
        # As llama-server: the vocab's BOS (and EOS) around the text, whose own were dropped (_render).
        return ChatPrompt(text, tuple(ids))

    def _prepare(self, messages: tuple[ChatMessage, ...], tools: Tools | None) -> tuple[ChatMessage, ...]:
        """llama-server's changes to the messages before a template sees them (common/chat.cpp's
        workarounds): a system message merged into the next one where the template ignores the system
        role, every content trimmed for StepFun's template; for the generic tool format, the tools told
        in a system message (tool_formats.generic_messages)."""
        traits = self._traits
        if tools is not None and tools.specs and tools.choice != "none" and self.tool_format is ToolFormat.GENERIC:
            messages = generic_messages(messages, tools, calls_as_text=not traits.tool_calls)
        if traits.trim_contents:
            messages = tuple(attrs.evolve(m, content=m.content.strip(),
                                          parts=None if m.parts is None else tuple(p.strip() for p in m.parts))
                             for m in messages)
        if not traits.system_role and messages and messages[0].role == "system":
            if len(messages) == 1:
                return ()
            first, second = messages[0], messages[1]
            merged = attrs.evolve(second, content=first.content + "\n" + second.content, parts=None)
            messages = (merged, *messages[2:])
        return messages

    def _render(self, messages: Sequence[ChatMessage], wrap: Callable[[str], str], now: datetime.datetime,
                tools: Tools | None, add_generation_prompt: bool = True,
                thinking: Thinking = DEFAULT_THINKING) -> str:
        """Run the template over `messages`, every text from the request passed through `wrap` (markers, or
        `str`), in the context llama-server's `--jinja` mode gives (common_chat_template_direct_apply)."""
        items = [self._item(message, wrap) for message in messages]
        context = {
            "messages": items,
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "add_generation_prompt": add_generation_prompt,
            "enable_thinking": self.thinks(thinking),
            "datetime": now.strftime("%b %d %Y"),
            "date_string": now.strftime("%d %b %Y"),
            "strftime_now": now.strftime,
            **_PRESERVE_REASONING,
            **thinking.context(),  # the server's and the request's template arguments, as given (compared)
        }
        if tools is not None and tools.specs:
            context["tools"] = _wrap_strings(tools.as_template_json(), wrap)
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

    def _item(self, message: ChatMessage, wrap: Callable[[str], str]) -> dict[str, Any]:
        """One message as the template sees it: a content string, or text parts where the template
        takes only those (or takes both and was given parts), Ministral 3's blocks for its system and
        assistant turns; an assistant turn's calls, their arguments as objects where the template reads
        them so (llama.cpp's supports_object_arguments), a tool turn's call id."""
        traits = self._traits
        parts = None if message.parts is None else tuple(wrap(p) for p in message.parts)
        value: Any = wrap(message.content)
        if traits.typed_only or (parts is not None and not traits.string_only):
            value = [{"type": "text", "text": part} for part in (parts if parts is not None else (value,))]
        if traits.ministral_blocks and message.role in ("system", "assistant") and isinstance(value, str):
            value = [{"type": "text", "text": value}]
        item: dict[str, Any] = {"role": message.role, "content": value}
        if message.name is not None:
            item["name"] = wrap(message.name)
        if message.tool_call_id is not None:
            item["tool_call_id"] = wrap(message.tool_call_id)
        if message.reasoning_content is not None:
            item["reasoning_content"] = wrap(message.reasoning_content)
        if message.tool_calls:
            item["tool_calls"] = [self._call(call, wrap) for call in message.tool_calls]
        return item

    def _call(self, call: ToolCall, wrap: Callable[[str], str]) -> dict[str, Any]:
        """One call of an assistant turn as llama-server gives it to the template."""
        arguments: Any = wrap(call.arguments)
        if self._traits.object_arguments:
            try:
                arguments = _wrap_strings(json.loads(call.arguments), wrap)
            except ValueError:
                raise RequestError(
                    f"tool call {call.name!r}: arguments are not JSON: {call.arguments[:80]!r}") from None
        item: dict[str, Any] = {"type": "function", "function": {"name": wrap(call.name), "arguments": arguments}}
        if call.id:
            item["id"] = wrap(call.id)
        return item


GENERIC_SYSTEM_PROMPT = (
    "You may call the tools listed below to fulfil the user's request.\n\n{tools}\n\n"
    "Answer with one JSON object only: either {{\"tool_calls\": [{{\"name\": ..., \"arguments\": {{...}}}}]}} to "
    "call tools, or {{\"response\": \"...\"}} to reply to the user."
)
"""The system text the generic tool format adds, in this project's words (llama-server's Generic handler
adds its own): the tools as JSON, and the two shapes of an answer."""


def generic_messages(messages: tuple[ChatMessage, ...], tools: Tools, *,
                     calls_as_text: bool) -> tuple[ChatMessage, ...]:
    """`messages` for a template without a tool format: the tools told in the system message (prepended to
    one there, as llama.cpp's add_system does); with `calls_as_text`, an assistant turn's calls written as
    its JSON answer and a tool result as a user turn (as llama.cpp's template polyfills wrote them)."""
    prompt = GENERIC_SYSTEM_PROMPT.format(tools=json.dumps(tools.as_template_json(), indent=2, ensure_ascii=False))
    if messages and messages[0].role == "system":
        first = messages[0]
        messages = (attrs.evolve(first, content=first.content + "\n\n" + prompt, parts=None), *messages[1:])
    else:
        messages = (ChatMessage("system", prompt), *messages)
    if not calls_as_text:
        return messages
    changed = []
    for message in messages:
        m = message
        if m.tool_calls:
            calls = [{"name": c.name, "arguments": _loads_or_text(c.arguments), **({"id": c.id} if c.id else {})}
                     for c in m.tool_calls]
            answer: dict[str, Any] = {"tool_calls": calls, **({"content": m.content} if m.content else {})}
            m = ChatMessage("assistant", json.dumps(answer, indent=2, ensure_ascii=False), m.name)
        elif m.role == "tool":
            result: dict[str, Any] = {**({"tool": m.name} if m.name else {}), "content": m.content}
            if m.tool_call_id:
                result["tool_call_id"] = m.tool_call_id
            m = ChatMessage("user", json.dumps({"tool_response": result}, indent=2, ensure_ascii=False))
        changed.append(m)
    return tuple(changed)


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _wrap_strings(value: Any, wrap: Callable[[str], str]) -> Any:
    """`value` (decoded JSON) with every string value passed through `wrap` (keys are refused for special
    text instead: _refuse_special_text)."""
    if isinstance(value, str):
        return wrap(value)
    if isinstance(value, Mapping):
        return {key: _wrap_strings(item, wrap) for key, item in value.items()}
    if isinstance(value, list):
        return [_wrap_strings(item, wrap) for item in value]
    return value


class _Content(str):
    """A content as the template sees it: the text is a marker; trimming yields the trimmed content's marker."""

    _markers: ContentMarkers
    _value: str

    def __new__(cls, markers: ContentMarkers, value: str) -> _Content:
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

    def escaped(self, ensure_ascii: bool) -> str:
        """A marker of the content as a JSON string writes it, without the quotes."""
        return self._markers.marker(json.dumps(self._value, ensure_ascii=ensure_ascii)[1:-1])

    def strip(self, chars: str | None = None, /) -> str:
        """The marker of the stripped content (Jinja's `trim` calls this)."""
        return _Content(self._markers, self._value.strip(chars))

    def lstrip(self, chars: str | None = None, /) -> str:
        """The marker of the content stripped on the left."""
        return _Content(self._markers, self._value.lstrip(chars))

    def rstrip(self, chars: str | None = None, /) -> str:
        """The marker of the content stripped on the right."""
        return _Content(self._markers, self._value.rstrip(chars))


class ContentMarkers:
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


def _maybe(markers: ContentMarkers, value: str | None) -> str | None:
    return None if value is None else markers.wrap(value)


def _keys(value: Any) -> Iterator[str]:
    """Every key of the objects in a decoded JSON value."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield str(key)
            yield from _keys(item)
    elif isinstance(value, list):
        for item in value:
            yield from _keys(item)


def _refuse_special_keys(messages: Sequence[ChatMessage], tools: Tools | None, tokenizer: Tokenizer) -> None:
    """RequestError if a key of the tools' schemas or of a call's arguments holds special-token text: keys
    reach the template as they are, never as markers."""
    for key in _keys(tools.as_template_json() if tools else []):
        if tokenizer.special_text_in(key) is not None:
            raise RequestError(f"tools: the key {key!r} contains special-token text, which cannot be kept as "
                               "plain text")
    for index, message in enumerate(messages):
        for call in message.tool_calls:
            for key in _keys(_loads_or_text(call.arguments)):
                if tokenizer.special_text_in(key) is not None:
                    raise RequestError(f"messages[{index}].tool_calls: the argument key {key!r} contains "
                                       "special-token text, which cannot be kept as plain text")


def _refuse_special_text(messages: Sequence[ChatMessage], tokenizer: Tokenizer, tools: Tools | None) -> None:
    """RequestError if a content, name, call or tool holds special-token text the template would let through."""
    if tools is not None and tokenizer.special_text_in(json.dumps(tools.as_template_json(), ensure_ascii=False)):
        raise RequestError("tools: contain special-token text, which this chat template cannot keep as plain text")
    for index, message in enumerate(messages):
        calls = " ".join(f"{c.id} {c.name} {c.arguments}" for c in message.tool_calls)
        for field, text in (("content", message.content), ("name", message.name or ""),
                            ("tool_calls", calls), ("tool_call_id", message.tool_call_id or "")):
            found = tokenizer.special_text_in(text)
            if found is not None:
                raise RequestError(
                    f"messages[{index}].{field}: contains the special-token text {found!r}, which this chat "
                    "template cannot keep as plain text"
                )


def _tool_calls_of(value: object, role: str, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls`: arguments kept as the JSON text they are (an object given is
    written compact, as llama-server dumps it)."""
    if value is None or value == []:
        return ()
    if role != "assistant":
        raise RequestError(f"{where}.tool_calls: only an assistant message has tool calls")
    if not isinstance(value, list):
        raise RequestError(f"{where}.tool_calls: must be a list of calls, got {json_kind(value)}")
    calls = []
    for k, call in enumerate(value):
        at = f"{where}.tool_calls[{k}]"
        if not isinstance(call, Mapping) or call.get("type", "function") != "function":
            raise RequestError(f"{at}: must be an object like {{'type': 'function', 'function': {{...}}}}")
        function = call.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RequestError(f"{at}.function: must be an object with a string 'name'")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise RequestError(f"{at}.id: must be a string, got {json_kind(call_id)}")
        calls.append(ToolCall(call_id, function["name"], arguments))
    return tuple(calls)


def _content_of(content: object, role: str, where: str) -> str:
    """A message content that is not a list of parts: a string (null for an assistant turn)."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""  # an assistant turn that only called tools (llama-server gives templates "")
    raise RequestError(f"{where}.content: must be a string or a list of text parts, got {json_kind(content)}")


def _parts_of(content: list[object], where: str) -> tuple[str, ...]:
    """The texts of a content given as a list of text parts."""
    texts = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        if not isinstance(part, Mapping):
            raise RequestError(f"{at}: must be an object like {{'type': 'text', 'text': ...}}, got {json_kind(part)}")
        kind = part.get("type")
        if kind != "text":
            raise RequestError(f"{at}.type: {kind!r} is not supported; only 'text' parts are")
        extra = sorted(set(part) - {"type", "text"})
        if extra:
            raise RequestError(f"{at}.{extra[0]}: unknown field of a text part; expected 'type' and 'text'")
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(f"{at}.text: must be a string, got {json_kind(text)}")
        texts.append(text)
    return tuple(texts)




def _continued(message: ChatMessage) -> str:
    """The text a continued message ends the prompt with: its content, text parts joined by a blank line
    (llama-server's render_content)."""
    return message.content if message.parts is None else "\n\n".join(message.parts)


def _raise_exception(message: object) -> NoReturn:
    """`raise_exception(...)` for templates: the template refuses these messages."""
    raise RequestError(f"messages: refused by the chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False) -> str:
    """`tojson` as chat templates expect it: plain JSON, no HTML escaping."""
    if isinstance(value, _ProbeList):
        value = value[:]  # a probe's parts written as JSON are not parts used as a list (llama.cpp's view)
    if isinstance(value, _ProbeArguments):
        value.read = True
    return json.dumps(_escaped(value, ensure_ascii), ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _escaped(value: Any, ensure_ascii: bool) -> Any:
    """`value` with each marked content replaced by a marker of its JSON-escaped text, so that the marker,
    written inside quotes, stands for exactly what json.dumps writes there."""
    if isinstance(value, _Content):
        return value.escaped(ensure_ascii)
    if isinstance(value, Mapping):
        return {key: _escaped(item, ensure_ascii) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_escaped(item, ensure_ascii) for item in value]
    return value


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
    tool_calls: bool = False  # the template reads an assistant turn's tool_calls
    object_arguments: bool = False  # ... and their arguments as an object (llama.cpp's supports_object_arguments)


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
    context = {"messages": messages, "tools": [], "bos_token": "", "eos_token": "", "add_generation_prompt": True}
    context.update(more)
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
        **_tool_traits(template),
    )


class _ProbeArguments(dict[str, Any]):
    """A probe's call arguments: notes whether the template read them as an object."""

    read = False

    def __getitem__(self, key: str) -> Any:
        """An argument read."""
        self.read = True
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        """An argument read with a default."""
        self.read = True
        return super().get(key, default)

    def items(self) -> Any:
        """The arguments iterated with their values."""
        self.read = True
        return super().items()

    def values(self) -> Any:
        """The arguments' values."""
        self.read = True
        return super().values()


def _tool_traits(template: jinja2.Template) -> dict[str, bool]:
    """Whether the template reads calls, and their arguments as objects: llama.cpp's probe (jinja/caps.cpp),
    a tool loop rendered with object arguments, then with string arguments."""
    tools = [{"type": "function", "function": {"name": "tool1", "description": "Tool description", "parameters": {
        "type": "object", "properties": {"arg": {"type": "string", "description": "Arg description"}},
        "required": ["arg"]}}}]
    for arguments in (_ProbeArguments(arg="value"), '{"arg": "value"}'):
        call = _ProbeMessage(role="assistant", content="", tool_calls=[
            {"id": "call00001", "type": "function", "function": {"name": "tool1", "arguments": arguments}}])
        loop = [_ProbeMessage(role="user", content="User message"), call,
                _ProbeMessage(role="tool", content="Tool response", tool_call_id="call00001"),
                _ProbeMessage(role="assistant", content="The tool response was 'tool response'"),
                _ProbeMessage(role="user", content="User message")]
        if _probe(template, loop, tools=tools) is None:
            continue
        reads = "tool_calls" in call.read
        return {"tool_calls": reads, "object_arguments": reads and isinstance(arguments, _ProbeArguments)
                and arguments.read}
    return {"tool_calls": False, "object_arguments": False}


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
