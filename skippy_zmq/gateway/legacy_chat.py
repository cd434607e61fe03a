"""llama.cpp's own C++ chat formats (`llama_chat_apply_template`), for `serve --no-jinja` and a built-in
template's name in `--chat-template` (`chatml`, `llama3`, `command-r`, ...), as llama-server's `--no-jinja`
renders them (docs/PROTOCOL.md §9.2, Chat templates). The format comes from the name, or llama.cpp
recognises it in a template's text; contents are kept plain text as in the Jinja path (chat.py):
rendered as markers, split, and tokenized without special-token parsing.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from skippy_zmq.errors import ChatTemplateError, ModelLoadError, RequestError
from skippy_zmq.gateway.chat import ChatMessage, ChatPrompt, ContentMarkers, generic_messages, parse_messages
from skippy_zmq.gateway.reasoning import DEFAULT_THINKING, ReasoningReader, Thinking
from skippy_zmq.gateway.tool_calls import Tools
from skippy_zmq.gateway.tool_formats import ToolFormat
from skippy_zmq.tokens.tokenizer import Tokenizer

CHATML = "chatml"
"""llama-server's format for a file without a chat template under `--no-jinja`."""


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise ModelLoadError("llama.cpp's chat formats need llama-cpp-python; install skippy-zmq[model]") from None
    return llama_cpp


@functools.cache
def builtin_names() -> tuple[str, ...]:
    """The names of llama.cpp's built-in chat formats (`llama_chat_builtin_templates`)."""
    llama_cpp = _llama_cpp()
    count = int(llama_cpp.llama_chat_builtin_templates(None, 0))
    names = (ctypes.c_char_p * count)()
    llama_cpp.llama_chat_builtin_templates(names, count)
    return tuple(name.decode("utf-8") for name in names if name is not None)


def apply(source: str, turns: Sequence[tuple[str, str]], add_generation_prompt: bool) -> str | None:
    """llama.cpp's rendering of (role, content) turns with the format `source` names or shows, None when it
    knows no such format."""
    llama_cpp = _llama_cpp()
    chat = (llama_cpp.llama_chat_message * max(len(turns), 1))()
    kept = []  # the encoded strings the C structs point to, alive until the call returns
    for index, (role, content) in enumerate(turns):
        kept += [role.encode("utf-8"), content.encode("utf-8")]
        chat[index].role, chat[index].content = kept[-2], kept[-1]
    size = 2 * sum(len(text) for text in kept) + 4096
    for _ in range(2):  # the first call says how long the text is when the buffer was short
        buffer = ctypes.create_string_buffer(size)
        written = int(llama_cpp.llama_chat_apply_template(source.encode("utf-8"), chat, len(turns),
                                                          add_generation_prompt, buffer, size))
        if written < 0:
            return None
        if written <= size:
            return buffer.raw[:written].decode("utf-8", "replace")
        size = written
    return None


class LegacyTemplate:
    """A chat format of llama.cpp's C++ (by name, or recognised in a template's text); read-only, shareable."""

    is_fallback = False
    tool_format = ToolFormat.GENERIC  # the formats know no tools: llama-server's generic handling

    def __init__(self, source: str, tokenizer: Tokenizer, *, origin: str) -> None:
        """ChatTemplateError naming `origin` when llama.cpp knows no format for `source`."""
        self.check_source(source, origin=origin)
        self.source = source
        self.origin = origin
        self._tokenizer = tokenizer
        self._bos = "" if tokenizer.bos_id is None else tokenizer.token_text(tokenizer.bos_id)

    @staticmethod
    def check_source(source: str, *, origin: str) -> None:
        """ChatTemplateError naming `origin` unless llama.cpp renders a turn with `source`."""
        if apply(source, [("user", "test")], True) is None:
            shown = source if len(source) < 40 else source[:37] + "..."
            raise ChatTemplateError(f"{origin}: llama.cpp has no chat format {shown!r}; its built-in names are "
                                    f"{', '.join(builtin_names())} (or give Jinja text without --no-jinja)")

    def reasoning_reader(self, thinking: Thinking = DEFAULT_THINKING) -> ReasoningReader | None:
        """Answers are not read for thought: the C++ formats know none (llama-server's --no-jinja)."""
        return None

    def render_text(self, messages: Sequence[Mapping[str, Any] | ChatMessage], *, tools: Tools | None = None,
                    now: datetime.datetime | None = None, add_generation_prompt: bool = True,
                    continue_final: bool = False, thinking: Thinking = DEFAULT_THINKING) -> str:
        """The prompt text (a leading BOS text the vocab adds anyway is dropped)."""
        turns, tail = self._turns(messages, tools, continue_final)
        return self._text(turns, add_generation_prompt or continue_final) + tail

    def render_ids(self, messages: Sequence[Mapping[str, Any] | ChatMessage], *, tools: Tools | None = None,
                   add_generation_prompt: bool = True, continue_final: bool = False,
                   thinking: Thinking = DEFAULT_THINKING) -> list[int]:
        """Prompt token ids: the format's text with special tokens parsed, contents as plain text."""
        return list(self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                continue_final=continue_final).ids)

    def render(self, messages: Sequence[Mapping[str, Any] | ChatMessage], *, tools: Tools | None = None,
               add_generation_prompt: bool = True, continue_final: bool = False) -> ChatPrompt:
        """Text and ids of the prompt (the contents located by markers, as ChatTemplate.render does)."""
        turns, tail = self._turns(messages, tools, continue_final)
        generation = add_generation_prompt or continue_final
        text = self._text(turns, generation) + tail
        markers = ContentMarkers([self.source, tail, *(content for _, content in turns)])
        marked = self._text([(role, markers.marker(content)) for role, content in turns], generation)
        segments = markers.segments(marked + (markers.marker(tail) if tail else ""))
        if "".join(piece for piece, _ in segments) == text:
            return ChatPrompt(text, tuple(self._tokenizer.encode_segments(segments)))
        # The format changed a content (trimmed it): the contents cannot be located, so none may hold
        # special-token text before the whole text is parsed.
        for role, content in [*turns, ("assistant", tail)]:
            found = self._tokenizer.special_text_in(content)
            if found is not None:
                raise RequestError(f"messages: a {role} message contains the special-token text {found!r}, which "
                                   "this chat format cannot keep as plain text")
        return ChatPrompt(text, tuple(self._tokenizer.encode(text, parse_special=True)))

    def _turns(self, messages: Sequence[Mapping[str, Any] | ChatMessage], tools: Tools | None,
               continue_final: bool) -> tuple[list[tuple[str, str]], str]:
        """(role, content) turns as llama-server passes them (parts joined by newlines; tools told in a
        system message, calls and results as JSON turns), and a continued last message's text."""
        given = parse_messages(messages)
        final = given[-1] if continue_final else None
        given = given[:-1] if continue_final else given
        if tools is not None and tools.specs and tools.choice != "none":
            given = generic_messages(given, tools, calls_as_text=True)
        tail = "" if final is None else (final.content if final.parts is None else "\n\n".join(final.parts))
        return [(message.role, message.content) for message in given], tail

    def _text(self, turns: Sequence[tuple[str, str]], add_generation_prompt: bool) -> str:
        text = apply(self.source, turns, add_generation_prompt)
        if text is None:  # checked at construction: llama.cpp knows the format
            raise ChatTemplateError(f"{self.origin}: llama.cpp could not render the chat")
        if self._tokenizer.add_bos and self._bos and text.startswith(self._bos):
            text = text[len(self._bos):]
        return text
