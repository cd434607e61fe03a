"""Reasoning ("thinking") models: turning thought on or off in the chat template, and reading an answer's
thought apart from its content (docs/PROTOCOL.md §9.2, Reasoning); socket-free.

A thinking model (DeepSeek-R1 distills, QwQ, Qwen 3, Command R7B, Magistral) writes its thought between
two markers before the answer, and its template may open the first marker itself (the prompt then ends
inside the thought). As llama-server does, the template gets `enable_thinking` (`serve --reasoning`,
a request's `chat_template_kwargs` or `reasoning_effort: "none"`), and with the `deepseek` reasoning
format (the default) the thought becomes the message's `reasoning_content`, streamed as
`reasoning_content` deltas, while `content` keeps the rest. Whole and streamed answers are read by the
same reader, so they agree to the character. A constrained answer (a JSON schema, tools) may follow a
thought: `thought_first` puts free text up to the closing marker before the constraint's grammar.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from typing import Any

import attrs

from skippy_zmq.errors import ConfigError, TableError
from skippy_zmq.tokens.constraint import JSON_WHITESPACE, Constraint, ConstraintKind


@attrs.frozen
class ThoughtMarkers:
    """One family's pair of thought markers, as its chat template writes them."""

    name: str
    start: str
    end: str


THOUGHT_MARKERS: tuple[ThoughtMarkers, ...] = (
    ThoughtMarkers("think", "<think>", "</think>"),  # DeepSeek-R1 distills, QwQ, Qwen 3, SmolLM 3, GLM
    ThoughtMarkers("seed", "<seed:think>", "</seed:think>"),  # ByteDance Seed-OSS
    ThoughtMarkers("command-r", "<|START_THINKING|>", "<|END_THINKING|>"),  # Command R7B
    ThoughtMarkers("mistral", "[THINK]", "[/THINK]"),  # Magistral, Ministral 3 reasoning
)
"""Thought markers by family, the first whose start a template's text holds wins (`<seed:think>`
holds no `<think>`). A newcomer adds one row."""


def _check_markers() -> None:
    names = [row.name for row in THOUGHT_MARKERS]
    if len(set(names)) != len(names):
        raise TableError(f"THOUGHT_MARKERS names must be distinct, got {names}")
    for row in THOUGHT_MARKERS:
        if not row.start or not row.end or row.start == row.end or row.start.strip() != row.start:
            raise TableError(f"THOUGHT_MARKERS row {row.name!r}: start and end must be distinct, non-empty, unpadded")


_check_markers()


def markers_of(template_source: str | None) -> ThoughtMarkers | None:
    """The thought markers a chat template writes (None: it writes none, or there is no template)."""
    if not template_source:
        return None
    return next((row for row in THOUGHT_MARKERS if row.start in template_source and row.end in template_source),
                None)


class ReasoningFormat(enum.Enum):
    """llama-server's `--reasoning-format` / `reasoning_format`: where an answer's thought goes."""

    NONE = "none"  # left in `content`, markers and all
    AUTO = "auto"  # as deepseek (llama-server's default)
    DEEPSEEK = "deepseek"  # in `reasoning_content`; `content` has the rest
    DEEPSEEK_LEGACY = "deepseek-legacy"  # in `reasoning_content`, and `content` keeps the whole text

    @classmethod
    def named(cls, value: object, where: str) -> ReasoningFormat:
        """The format of a name; ConfigError naming `where` and the names otherwise."""
        for member in cls:
            if value == member.value:
                return member
        names = ", ".join(member.value for member in cls)
        raise ConfigError(f"{where} {value!r} is not a reasoning format; expected one of {names}")


REASONING_SWITCH = {"on": True, "off": False, "auto": None}
"""`serve --reasoning` values: thought on, off, or as the template decides (llama-server's names)."""


@attrs.frozen
class Thinking:
    """How one chat request treats thought: `enable` (None: as the template decides), where the answer's
    thought goes, and the extra template variables (`chat_template_kwargs`, `reasoning_effort`)."""

    enable: bool | None = None
    format: ReasoningFormat = ReasoningFormat.AUTO
    template_kwargs: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_request(cls, defaults: Thinking, kwargs: Mapping[str, Any] | None, effort: str | None,
                     reasoning_format: str | None) -> Thinking:
        """The request's settings over the server's (`defaults`): llama-server's order, the server's
        template arguments, then the request's, `enable_thinking` among them (a boolean), then
        `reasoning_effort` ("none" turns thought off, another level is given to the template)."""
        merged = dict(defaults.template_kwargs)
        merged.update(kwargs or {})
        enable = defaults.enable
        if "enable_thinking" in merged:
            value = merged.pop("enable_thinking")
            if not isinstance(value, bool):
                raise ConfigError(f"chat_template_kwargs.enable_thinking must be true or false, got {value!r}")
            enable = value
        if effort == "none":
            enable = False
            merged.pop("reasoning_effort", None)
        elif effort is not None:
            merged["reasoning_effort"] = effort
        shape = defaults.format if reasoning_format is None else ReasoningFormat.named(reasoning_format,
                                                                                      "reasoning_format")
        return cls(enable, shape, tuple(sorted(merged.items())))

    @classmethod
    def from_options(cls, switch: str, reasoning_format: str, kwargs_json: str | None) -> Thinking:
        """The server's defaults from `--reasoning`, `--reasoning-format` and `--chat-template-kwargs`."""
        if switch not in REASONING_SWITCH:
            raise ConfigError(f"--reasoning {switch!r} must be one of {', '.join(REASONING_SWITCH)}")
        kwargs: dict[str, Any] = {}
        if kwargs_json is not None:
            try:
                kwargs = json.loads(kwargs_json)
            except ValueError as exc:
                raise ConfigError(f"--chat-template-kwargs is not JSON: {exc}") from None
            if not isinstance(kwargs, dict):
                raise ConfigError(f"--chat-template-kwargs must be a JSON object, got {kwargs_json[:80]!r}")
        base = cls(REASONING_SWITCH[switch], ReasoningFormat.named(reasoning_format, "--reasoning-format"))
        try:
            return cls.from_request(base, kwargs, None, None)
        except ConfigError as exc:
            raise ConfigError(f"--chat-template-kwargs: {exc}") from None

    def context(self) -> dict[str, Any]:
        """The template variables beyond `enable_thinking`."""
        return dict(self.template_kwargs)


DEFAULT_THINKING = Thinking()
"""Thought as the template decides, read into `reasoning_content`, no extra template variables."""


REASONING = "reasoning"
CONTENT = "content"
THOUGHT_SPACE = r"/[ \t\n]{0,8}/"
"""What may stand between a thought's closing marker and a constrained answer."""


def answer_rules(constraint: Constraint, *, generated: bool = False) -> str | None:
    """Lark rules defining `answer` as `constraint` (a JSON schema or object; with `generated`, a Lark grammar
    of this package's own, whose `start` becomes `answer`), or None for a language a thought cannot be put
    before (a regex, a GBNF or a client's Lark grammar)."""
    if constraint.kind is ConstraintKind.LARK and generated:
        body = constraint.text.removeprefix("%llguidance {}\n")
        return re.sub(r"^start:", "answer:", body, count=1, flags=re.MULTILINE)
    if constraint.kind is ConstraintKind.JSON_OBJECT:
        schema: Any = {"type": "object"}
    elif constraint.kind is ConstraintKind.JSON_SCHEMA:
        schema = json.loads(constraint.text)
        schema = {} if schema is True else schema
    else:
        return None
    if not isinstance(schema, dict):
        return None  # `false`: nothing to think before
    rules = {**schema.get("x-guidance", {}), "whitespace_pattern": JSON_WHITESPACE}
    return "answer: %json " + json.dumps({**schema, "x-guidance": rules}, ensure_ascii=False)


def thought_first(rules: str, reader: ReasoningReader, special: Mapping[str, int]) -> str:
    """An llguidance Lark grammar: a thought (free text) and its closing marker, then the constrained answer
    (`rules`: Lark rules defining `answer`, without `start`: `answer_rules`), as llama-server lets a thinking model
    think before a schema's answer. Where the template opened the thought it must be closed; elsewhere it
    may be opened first or skipped. `special`: the markers the vocabulary has as one token (by id: a grammar
    names the model's own token, never the marker spelled in bytes)."""
    start, end = (f"<[{special[text]}]>" if text in special else json.dumps(text)
                  for text in (reader.markers.start, reader.markers.end))
    if reader.markers.end in special:  # a token the text regex cannot match ends the thought
        thought = [f"thought: THOUGHT {end}", r"THOUGHT: /(.|\n)*/"]
    else:
        thought = [f"thought[stop={end}]: " + r"/(.|\n)*/"]
    head = "start: thought SPACE answer" if reader.opened else f"start: answer | {start} thought SPACE answer"
    return "\n".join(["%llguidance {}", head, f"SPACE: {THOUGHT_SPACE}", *thought, rules]) + "\n"


@attrs.frozen
class ReasoningReader:
    """How one request's answers are read for thought: the template's markers, whether the prompt ends
    inside a thought (the template opened it), and the legacy format (content keeps the whole text)."""

    markers: ThoughtMarkers
    opened: bool = False
    legacy: bool = False

    def stream(self) -> ThoughtStream:
        """A reader of one choice's streamed answer."""
        return ThoughtStream(self)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole answer's thought (None: it has none, or an empty one) and content, as the stream gives them."""
        stream = self.stream()
        pieces = stream.feed(text) + stream.finish()
        thought = "".join(piece for kind, piece in pieces if kind == REASONING)
        content = "".join(piece for kind, piece in pieces if kind == CONTENT)
        return thought or None, content


class ThoughtStream:
    """Reads one choice's answer as it arrives into (kind, text) pieces, kind REASONING or CONTENT.

    Text that may still turn out to be a marker is held back, and so is whitespace at the edges of the
    thought and right after it (dropped there, as llama-server trims them)."""

    def __init__(self, reader: ReasoningReader) -> None:
        self._markers = reader.markers
        self._legacy = reader.legacy
        self._state = "thought" if reader.opened else "before"
        self._held = ""
        self._started = False  # some text of the current part (thought or content after it) was given

    def feed(self, text: str) -> list[tuple[str, str]]:
        """The pieces `text` completes (the legacy format gives its text as content too)."""
        pieces = self._feed(text)
        if self._legacy:
            return [(CONTENT, text)] * bool(text) + [piece for piece in pieces if piece[0] == REASONING]
        return pieces

    def finish(self) -> list[tuple[str, str]]:
        """The pieces held back when the answer ends (an unterminated thought is all thought)."""
        held, self._held = self._held, ""
        if self._legacy:
            return [(REASONING, held.rstrip())] if self._state == "thought" and held.strip() else []
        if self._state == "before":
            return [(CONTENT, held)] if held else []
        if self._state == "thought":
            held = held.rstrip()
            return [(REASONING, held)] if held else []
        return []  # whitespace right after the thought

    def _feed(self, text: str) -> list[tuple[str, str]]:
        self._held += text
        pieces: list[tuple[str, str]] = []
        while True:
            before = (self._state, len(self._held))
            piece = getattr(self, f"_in_{self._state}")()
            if piece is not None and piece[1]:
                pieces.append(piece)
            if (self._state, len(self._held)) == before:
                return pieces

    def _in_before(self) -> tuple[str, str] | None:
        start = self._markers.start
        lead = self._held.lstrip()
        if not lead or (len(lead) < len(start) and start.startswith(lead)):
            return None  # still possibly the opening marker
        if lead.startswith(start):
            self._state, self._held = "thought", lead[len(start):]
            return None
        self._state = "content"
        held, self._held = self._held, ""
        return (CONTENT, held)

    def _in_thought(self) -> tuple[str, str] | None:
        end = self._markers.end
        if not self._started:
            self._held = self._held.lstrip()
        at = self._held.find(end)
        if at >= 0:
            thought = self._held[:at].rstrip()
            self._state, self._held, self._started = "after", self._held[at + len(end):], False
            return (REASONING, thought)
        keep = _tail_to_hold(self._held, end)
        ready, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        if ready:
            self._started = True
        return (REASONING, ready)

    def _in_after(self) -> tuple[str, str] | None:
        lead = self._held.lstrip()
        if not lead:
            self._held = ""
            return None
        self._state, self._held = "content", lead
        return None

    def _in_content(self) -> tuple[str, str] | None:
        held, self._held = self._held, ""
        return (CONTENT, held)


def _tail_to_hold(text: str, marker: str) -> int:
    """Characters at the end of `text` to hold back: trailing whitespace, and a tail that may be the start
    of `marker` (with the whitespace before it)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size + len(text[:-size]) - len(text[:-size].rstrip())
    return len(text) - len(text.rstrip())
