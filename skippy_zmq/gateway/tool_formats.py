"""OpenAI tool calling, the formats: how a model writes its calls, one row per format in FORMATS (how a
chat template's source names it, how an answer is read, whole or streamed, the grammar that keeps a
constrained answer to valid calls), `parse_tool_calls` for a whole answer and `ToolCallStream` for one
arriving in pieces (docs/PROTOCOL.md §9.2, "Tool calls"). Socket-free.

An answer whose calls do not all parse (broken JSON, a tool the request did not give, a call cut off
by the end of the answer) is all content and no calls, as llama-server answers it: the caller then
finishes with "stop". The stream sends free text at once, holding back only what may be the start of
a call's marker, and a call's arguments as they arrive; what it sends adds up to `parse_tool_calls` of
the whole text, except when a call breaks after its first pieces went out (possible only when no
grammar held the model to the format): those pieces cannot be taken back, and the rest of the text
follows as content.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from skippy_zmq.errors import RequestError, check_rows
from skippy_zmq.gateway.tool_calls import (
    CallIds,
    ParsedAnswer,
    Path,
    ToolCall,
    Tools,
    ToolSpec,
    compact_json,
    scan_json,
)


class ToolFormat(enum.StrEnum):
    """The tool-call formats, by the name llama.cpp's chat code gives them."""

    HERMES = "hermes"
    LLAMA3_JSON = "llama3-json"
    MISTRAL = "mistral"
    MISTRAL_ARGS = "mistral-args"
    GENERIC = "generic"


@attrs.frozen
class _Call:
    """A call as far as it is read: its name once whole (None before), its compact arguments so far."""

    name: str | None
    arguments: str
    done: bool


@attrs.frozen
class _Answer:
    """An answer as far as it is read: its content (without what is held back), its calls, and whether
    it is broken (`failed_at`: where the broken call began)."""

    content: str
    calls: tuple[_Call, ...]
    failed_at: int | None = None


@attrs.frozen
class _Region:
    """The calls of one marked region (a marker and what follows it), and where it ends (None while open)."""

    calls: tuple[_Call, ...]
    end: int | None
    error: bool


def _held(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of `text` may be the start of one of `markers`."""
    for size in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        if any(m.startswith(text[-size:]) for m in markers):
            return size
    return 0


def _calls_of(captured: Mapping[str, str], done: frozenset[str], count: int) -> tuple[_Call, ...]:
    """The calls `name:i` / `args:i` captures describe, in order."""
    calls = []
    for i in range(count):
        name_label, args_label = f"name:{i}", f"args:{i}"
        if name_label not in captured and args_label not in captured:
            break
        name = json.loads(captured[name_label]) if name_label in done else None
        known = None if name is None else name if isinstance(name, str) else ""  # "" names no tool
        calls.append(_Call(known, captured.get(args_label, ""), args_label in done and name_label in done))
    return tuple(calls)


def _labelled(labels: Mapping[Path, str]) -> Callable[[Path], str | None]:
    """scan_json's `capture` for a fixed table of paths."""

    def capture(path: Path) -> str | None:
        return labels.get(path)

    return capture


def _json_region(text: str, start: int, capture: Callable[[Path], str | None], count: int) -> _Region:
    """A region that is one JSON value holding `count` calls at most."""
    scan = scan_json(text, start, capture)
    return _Region(_calls_of(scan.captured, scan.done, count), scan.end, scan.error)


def _hermes_region(text: str, start: int, final: bool) -> _Region:
    """`<tool_call>` then one JSON object {"name": ..., "arguments": {...}}, then `</tool_call>`."""
    labels: dict[Path, str] = {("name",): "name:0", ("arguments",): "args:0"}
    region = _json_region(text, start, _labelled(labels), 1)
    if region.end is None or region.error:
        return region
    rest = text[region.end:]
    gap = len(rest) - len(rest.lstrip())
    if rest.lstrip().startswith("</tool_call>"):
        return attrs.evolve(region, end=region.end + gap + len("</tool_call>"))
    if final and not rest.strip():
        return attrs.evolve(region, end=len(text))  # a model that ended without the closing tag
    waiting = not final and "</tool_call>".startswith(rest.lstrip())
    return _Region(region.calls, None, not waiting)


def _mistral_region(text: str, start: int, final: bool) -> _Region:
    """`[TOOL_CALLS]` then a JSON list of {"name": ..., "arguments": {...}} objects."""

    def label(path: Path) -> str | None:
        if len(path) == 2 and isinstance(path[0], int) and path[1] in ("name", "arguments"):
            return f"{'name' if path[1] == 'name' else 'args'}:{path[0]}"
        return None

    return _json_region(text, start, label, 1 << 16)


_ARGS_NAME = re.compile(r"([a-zA-Z0-9_-]*)(\[CALL_ID\][a-zA-Z0-9]*)?(\[ARGS\])?")


def _mistral_args_region(text: str, start: int, final: bool) -> _Region:
    """`[TOOL_CALLS]name[ARGS]{...}` (Mistral Small 3.2 puts `[CALL_ID]id` before `[ARGS]`)."""
    match = _ARGS_NAME.match(text, start)
    assert match is not None  # every part of the pattern may be empty
    if match.group(3) is None:
        rest = text[match.end():]
        waiting = not final and (not rest or any(m.startswith(rest) for m in ("[ARGS]", "[CALL_ID]")))
        return _Region((), None, not waiting)
    name = match.group(1)
    scan = scan_json(text, match.end(), lambda path: "args:0" if path == () else None)
    args = scan.captured.get("args:0", "")
    error = scan.error or (bool(args) and not args.startswith("{"))
    return _Region((_Call(name, args, "args:0" in scan.done),), scan.end, error)


@attrs.frozen
class _Marked:
    """A format whose calls follow a marker in free text: the marker, and how a region is read."""

    marker: str
    region: Callable[[str, int, bool], _Region]

    def scan(self, text: str, final: bool) -> _Answer:
        """Content and calls of `text` (`final`: the whole answer, nothing held back)."""
        content: list[str] = []
        calls: list[_Call] = []
        pos = 0
        while True:
            at = text.find(self.marker, pos)
            if at < 0:
                tail = text[pos:]
                content.append(tail if final else tail[: len(tail) - _held(tail, (self.marker,))])
                return _Answer("".join(content), tuple(calls))
            content.append(text[pos:at])
            region = self.region(text, at + len(self.marker), final)
            calls += region.calls
            if region.error or (final and region.end is None) or (region.end is not None and not region.calls):
                return _Answer("".join(content), tuple(calls), failed_at=at)
            if region.end is None:
                return _Answer("".join(content), tuple(calls))
            pos = region.end


def _llama3_scan(text: str, final: bool) -> _Answer:
    """The whole answer one JSON object {"name": ..., "parameters": {...}}, maybe after `<|python_tag|>`;
    any other answer is content."""
    body = text.lstrip()
    tag = "<|python_tag|>"
    if body.startswith(tag):
        body = body[len(tag):].lstrip()
    elif not final and tag.startswith(body):
        return _Answer("", ())  # only whitespace, or the start of the tag, so far
    if not body.startswith("{"):
        return _Answer(text, ()) if final or body else _Answer("", ())
    labels: dict[Path, str] = {("name",): "name:0", ("parameters",): "args:0", ("arguments",): "args:0"}
    start = len(text) - len(body)
    region = _json_region(text, start, _labelled(labels), 1)
    trailing = region.end is not None and text[region.end:].strip()
    if region.error or trailing or (final and (region.end is None or not region.calls)):
        return _Answer("", region.calls, failed_at=0)
    return _Answer("", region.calls)


def _generic_scan(text: str, final: bool) -> _Answer:
    """llama-server's Generic format: the whole answer one JSON object, {"tool_calls": [{"name": ...,
    "arguments": {...}}, ...]}, {"tool_call": {...}} or {"response": "..."}; any other answer is content."""
    body = text.lstrip()
    if not body.startswith("{"):
        return _Answer(text if final or body else "", ())

    def label(path: Path) -> str | None:
        if path == ("response",):
            return "response"
        if len(path) == 3 and path[0] == "tool_calls" and isinstance(path[1], int):
            return {"name": f"name:{path[1]}", "arguments": f"args:{path[1]}"}.get(str(path[2]))
        if len(path) == 2 and path[0] == "tool_call":
            return {"name": "name:0", "arguments": "args:0"}.get(str(path[1]))
        return None

    scan = scan_json(text, len(text) - len(body), label)
    calls = _calls_of(scan.captured, scan.done, 1 << 16)
    trailing = scan.end is not None and text[scan.end:].strip()
    response = scan.captured.get("response")
    if scan.error or trailing or (final and (scan.end is None or (response is None and not calls))):
        return _Answer("", calls, failed_at=0)
    if response is None:
        return _Answer("", calls)
    if "response" in scan.done:
        value = json.loads(response)
        return _Answer(value if isinstance(value, str) else json.dumps(value, indent=2, ensure_ascii=False), calls)
    return _Answer(json.loads(response + '"') if response.startswith('"') else "", calls)


# --- grammars (llguidance's Lark syntax) -----------------------------------------------------------

_WHITESPACE_RULES = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# JSON as json.dumps writes it (", " and ": ", as these models saw their calls): a model cannot loop on spaces.


def _schema(document: Mapping[str, Any]) -> str:
    """`%json {...}` of a JSON schema, with JSON's whitespace fixed."""
    return "%json " + json.dumps({**document, "x-guidance": _WHITESPACE_RULES}, ensure_ascii=False)


def _call_schema(specs: Sequence[ToolSpec], arguments_key: str) -> dict[str, Any]:
    """A call object {"name": ..., arguments_key: ...} naming one of `specs`."""
    options = [{"type": "object", "properties": {"name": {"const": s.name}, arguments_key: dict(s.parameters)},
                "required": ["name", arguments_key], "additionalProperties": False} for s in specs]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _marker(text: str, special: Mapping[str, int]) -> str:
    """A marker in a rule: the special token (by its id) when the vocabulary has one for it, else its text."""
    return f"<[{special[text]}]>" if text in special else json.dumps(text)


def _lark(rules: Sequence[str]) -> str:
    return "%llguidance {}\n" + "\n".join(rules) + "\n"


def _free_text_then(opening: str, special: Mapping[str, int], rest: str) -> list[str]:
    """`start` for tool_choice auto: any text, or text up to the opening marker and then calls."""
    if opening in special:
        return [f"start: TEXT | TEXT {_marker(opening, special)} {rest}", "TEXT: /(.|\\n)*/"]
    return [f"start: TEXT | head {rest}", f"head[lazy]: TEXT {json.dumps(opening)}", "TEXT: /(.|\\n)*/"]


def _hermes_grammar(tools: Tools, special: Mapping[str, int]) -> str:
    close = _marker("</tool_call>", special)
    more = f' ("\\n" {_marker("<tool_call>", special)} body)*' if tools.parallel else ""
    body = [f'body: "\\n" call "\\n" {close}', f"call: {_schema(_call_schema(tools.allowed(), 'arguments'))}"]
    if tools.choice == "auto":
        return _lark([*_free_text_then("<tool_call>", special, f"body{more}"), *body])
    return _lark([f"start: {_marker('<tool_call>', special)} body{more}", *body])


def _llama3_grammar(tools: Tools, special: Mapping[str, int]) -> str:
    tag = "<|python_tag|>"
    call = f"call: {_marker(tag, special) + ' ' if tag in special else ''}" + _schema(
        _call_schema(tools.allowed(), "parameters"))
    if tools.choice == "auto":
        return _lark(["start: TEXT? | call", "TEXT: /[^{](.|\\n)*/", call])
    return _lark(["start: call", call])


def _mistral_grammar(tools: Tools, special: Mapping[str, int]) -> str:
    listing: dict[str, Any] = {"type": "array", "items": _call_schema(tools.allowed(), "arguments"), "minItems": 1}
    if not tools.parallel:
        listing["maxItems"] = 1
    calls = f"calls: {_schema(listing)}"
    if tools.choice == "auto":
        return _lark([*_free_text_then("[TOOL_CALLS]", special, "calls"), calls])
    return _lark([f"start: {_marker('[TOOL_CALLS]', special)} calls", calls])


def _mistral_args_grammar(tools: Tools, special: Mapping[str, int]) -> str:
    opening, args = _marker("[TOOL_CALLS]", special), _marker("[ARGS]", special)
    options = " | ".join(f"call_{k}" for k in range(len(tools.allowed())))
    rules = [f"call: {options}"] + [f"call_{k}: {json.dumps(s.name)} {args} {_schema(dict(s.parameters))}"
                                    for k, s in enumerate(tools.allowed())]
    more = f" ({opening} call)*" if tools.parallel else ""
    if tools.choice == "auto":
        return _lark([*_free_text_then("[TOOL_CALLS]", special, f"call{more}"), *rules])
    return _lark([f"start: {opening} call{more}", *rules])


def _generic_grammar(tools: Tools, special: Mapping[str, int]) -> str:
    """llama-server's Generic grammar: not lazy, the whole answer JSON even for tool_choice auto."""
    call = _call_schema(tools.allowed(), "arguments")
    if tools.parallel:
        wanted: dict[str, Any] = {"type": "object", "required": ["tool_calls"], "additionalProperties": False,
                                  "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}}}
    else:
        wanted = {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                  "additionalProperties": False}
    if tools.choice == "auto":
        response = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                    "additionalProperties": False}
        wanted = {"anyOf": [wanted, response]}
    return _lark([f"start: {_schema(wanted)}"])


@attrs.frozen
class ToolFormatRow:
    """One tool-call format: how a template's source shows it, how an answer is read (`scan`: text, whether
    it is the whole answer), the grammar of its calls, the ids its templates expect, the markers a
    tokenizer should keep as special tokens."""

    detect: Callable[[str], bool]
    scan: Callable[[str, bool], _Answer]
    grammar: Callable[[Tools, Mapping[str, int]], str]
    markers: tuple[str, ...]
    id_prefix: str = "call_"
    id_length: int = 24


_HERMES = _Marked("<tool_call>", _hermes_region)
_MISTRAL = _Marked("[TOOL_CALLS]", _mistral_region)
_MISTRAL_ARGS = _Marked("[TOOL_CALLS]", _mistral_args_region)

# In the order llama.cpp's chat code tried them on a template's source (common/chat.cpp before its
# differential parser): the first row whose `detect` holds is the template's format.
FORMATS: dict[ToolFormat, ToolFormatRow] = {
    # Qwen 2.5 and 3, Hermes 2 Pro and 3; not Qwen3-Coder's XML calls (<function=...>).
    ToolFormat.HERMES: ToolFormatRow(lambda s: "<tool_call>" in s and "<function=" not in s, _HERMES.scan,
                                     _hermes_grammar, ("<tool_call>", "</tool_call>")),
    # Llama 3.1 to 3.3: tool results in an `ipython` turn.
    ToolFormat.LLAMA3_JSON: ToolFormatRow(
        lambda s: "<|start_header_id|>ipython<|end_header_id|>" in s or "<|python_tag|>" in s,
        _llama3_scan, _llama3_grammar, ("<|python_tag|>",)),
    # Devstral, Magistral, Ministral 3, Mistral Small 3.2: the name before [ARGS]. Mistral's templates
    # check that call ids are nine letters or digits.
    ToolFormat.MISTRAL_ARGS: ToolFormatRow(lambda s: "[TOOL_CALLS]" in s and "[ARGS]" in s, _MISTRAL_ARGS.scan,
                                           _mistral_args_grammar, ("[TOOL_CALLS]", "[ARGS]"), "", 9),
    # Mistral Nemo and Small before 3.2: a JSON list after [TOOL_CALLS].
    ToolFormat.MISTRAL: ToolFormatRow(lambda s: "[TOOL_CALLS]" in s, _MISTRAL.scan, _mistral_grammar,
                                      ("[TOOL_CALLS]",), "", 9),
    ToolFormat.GENERIC: ToolFormatRow(lambda s: True, _generic_scan, _generic_grammar, ()),
}
check_rows(FORMATS, ToolFormat, "tool_formats.FORMATS")
if list(FORMATS)[-1] is not ToolFormat.GENERIC:
    raise RuntimeError("tool_formats.FORMATS: the generic row detects every template, so it must come last")


def detect_format(source: str | None) -> ToolFormat:
    """The tool-call format of a chat template's source (generic for none)."""
    return next(name for name, row in FORMATS.items() if row.detect(source or ""))


def call_ids(format: ToolFormat, *, seed: int | None = None) -> CallIds:
    """Ids of the shape `format`'s templates take (`seed`: repeatable, for tests)."""
    row = FORMATS[format]
    return CallIds(prefix=row.id_prefix, length=row.id_length, seed=seed)


def tool_grammar(format: ToolFormat, tools: Tools, *, special_tokens: Mapping[str, int] | None = None) -> str | None:
    """The llguidance Lark grammar that holds an answer to `tools.choice` (None for "none": no constraint):
    calls only for "required" or a named tool, free text or calls for "auto" (lazy: free until the call's
    marker). `special_tokens`: the markers the vocabulary has as special tokens, with their ids (written
    `<[id]>`: the model's own token, never the marker spelled in bytes)."""
    if tools.choice == "none" or not tools.specs:
        return None
    return FORMATS[format].grammar(tools, special_tokens or {})


def _finished(answer: _Answer, names: frozenset[str], text: str) -> _Answer:
    """`answer` of a whole text, or all of it as content when a call is broken or names no tool."""
    if answer.failed_at is not None or any(not c.done or c.name not in names for c in answer.calls):
        return _Answer(text, ())
    return answer


def parse_tool_calls(format: ToolFormat, text: str, tools: Tools, *, ids: CallIds | None = None) -> ParsedAnswer:
    """A whole answer's content and calls; a text whose calls do not all parse is all content."""
    if tools.choice == "none" or not tools.specs:
        return ParsedAnswer(text)
    answer = _finished(FORMATS[format].scan(text, True), tools.names, text)
    ids = ids or call_ids(format)
    return ParsedAnswer(answer.content, tuple(ToolCall(ids.next(), c.name or "", c.arguments) for c in answer.calls))


class ToolCallStream:
    """An answer read as it is decoded: each `feed` and the `finish` give OpenAI chat-completion deltas
    ({"content": ...} and {"tool_calls": [...]}) whose sum is parse_tool_calls of the whole text."""

    def __init__(self, format: ToolFormat, tools: Tools, *, ids: CallIds | None = None) -> None:
        """A stream of `format` answers for `tools`."""
        self._row = FORMATS[format]
        self._names = tools.names
        self._ids = ids or call_ids(format)
        self._text = ""
        self._plain = tools.choice == "none" or not tools.specs  # no calls to look for
        self._content = ""  # content sent
        self._calls: list[ToolCall] = []  # calls whose header went out, with the arguments sent

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        """The calls sent so far, with the arguments sent."""
        return tuple(self._calls)

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The deltas `piece` completes."""
        self._text += piece
        if self._plain:
            return self._send_content(piece)
        return self._send(self._row.scan(self._text, False))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of the end of the answer: what was held back, as content when no call came of it."""
        if self._plain:
            return []
        answer = self._row.scan(self._text, True)
        if answer.failed_at is None and any(not c.done or c.name not in self._names for c in answer.calls):
            answer = attrs.evolve(answer, failed_at=len(self._text))
        return self._send(answer)

    def _send_content(self, text: str) -> list[dict[str, Any]]:
        self._content += text
        return [{"content": text}] if text else []

    def _send(self, answer: _Answer) -> list[dict[str, Any]]:
        broken = answer.failed_at is not None or any(c.name is not None and c.name not in self._names
                                                     for c in answer.calls)
        if broken:
            self._plain = True
            if not self._calls and self._text.startswith(self._content):
                return self._send_content(self._text[len(self._content):])
            return self._send_content(self._text[answer.failed_at or 0:])  # pieces already out: see the docstring
        deltas = self._send_content(answer.content[len(self._content):])
        for index, call in enumerate(answer.calls):
            if call.name is None:
                break  # later calls wait for this one's name
            if index == len(self._calls):
                self._calls.append(ToolCall(self._ids.next(), call.name, ""))
                deltas.append({"tool_calls": [{"index": index, "id": self._calls[index].id, "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            sent = self._calls[index].arguments
            if len(call.arguments) > len(sent):
                self._calls[index] = attrs.evolve(self._calls[index], arguments=call.arguments)
                deltas.append({"tool_calls": [{"index": index,
                                               "function": {"arguments": call.arguments[len(sent):]}}]})
        return deltas


def assemble(deltas: Sequence[Mapping[str, Any]]) -> ParsedAnswer:
    """The answer a client puts together from a stream's deltas (content joined, each call's pieces)."""
    content: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        content.append(delta.get("content", ""))
        for item in delta.get("tool_calls", ()):
            call = calls.setdefault(item["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] = item.get("id", call["id"])
            call["name"] += item.get("function", {}).get("name", "")
            call["arguments"] += item.get("function", {}).get("arguments", "")
    return ParsedAnswer("".join(content), tuple(ToolCall(c["id"], c["name"], c["arguments"])
                                                for _, c in sorted(calls.items())))


def format_named(name: str) -> ToolFormat:
    """The format called `name`; RequestError naming the known ones."""
    try:
        return ToolFormat(name)
    except ValueError:
        raise RequestError(f"tool-call format {name!r} is unknown; known: {', '.join(FORMATS)}") from None


__all__ = ["FORMATS", "ToolCallStream", "ToolFormat", "assemble", "call_ids", "compact_json", "detect_format",
           "parse_tool_calls", "tool_grammar"]
