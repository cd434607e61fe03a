"""What a constrained session's text must match, socket-free: a JSON schema, any JSON object, a
regular expression, a GBNF grammar (llama.cpp's syntax) or a Lark grammar, checked where it
arrives and turned into llguidance's grammar where it is built (docs/PROTOCOL.md §2.6 and §9.2).

llguidance is imported on first use: a process that never meets a constraint never loads it.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from skippy_zmq.errors import RequestError, check_rows

MAX_CONSTRAINT_BYTES = 131_072
"""Longest constraint text, in UTF-8 bytes: a schema of a hundred tools fits; it travels once per
session through every stage (docs/PROTOCOL.md §2.5)."""
JSON_WHITESPACE = r"(?:[ ]?|\n[ \t]{0,20})"
"""The whitespace a JSON constraint allows between tokens: none, one space, or a newline and an
indent of at most 20 (llama.cpp's JSON grammars allow the same), so a small model cannot loop on
spaces."""


class ConstraintError(RequestError):
    """A constraint is not valid, or asks for what the constrained decoder cannot enforce."""


class ConstraintKind(enum.IntEnum):
    """The constraint languages; the ids are wire format (docs/PROTOCOL.md §2.6)."""

    JSON_SCHEMA = 1
    JSON_OBJECT = 2
    REGEX = 3
    GBNF = 4
    LARK = 5


@attrs.frozen
class KindRow:
    """One constraint language: its name in messages and how its text becomes llguidance's grammar."""

    name: str
    grammar: Callable[[str], str]


def _json_schema(text: str) -> str:
    from llguidance import LLMatcher

    if text.strip() in ("true", "false"):  # the boolean schemas: any JSON value, or none
        if text.strip() == "false":
            raise ValueError("the schema false matches no text")
        text = "{}"
    return LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_pattern": JSON_WHITESPACE})


def _json_object(_: str) -> str:
    return _json_schema('{"type": "object"}')


def _from(format_name: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        from llguidance import grammar_from

        return grammar_from(format_name, text)  # type: ignore[arg-type]

    return convert


CONSTRAINT_KINDS: Mapping[ConstraintKind, KindRow] = {
    ConstraintKind.JSON_SCHEMA: KindRow("json_schema", _json_schema),
    ConstraintKind.JSON_OBJECT: KindRow("json_object", _json_object),
    ConstraintKind.REGEX: KindRow("regex", _from("regex")),
    ConstraintKind.GBNF: KindRow("gbnf", _from("gbnf")),
    ConstraintKind.LARK: KindRow("lark", _from("lark")),
}
"""One row per constraint language; a kind without its row fails at import."""
check_rows(CONSTRAINT_KINDS, ConstraintKind, "skippy_zmq.tokens.constraint.CONSTRAINT_KINDS")


def _check_text(instance: Constraint, _: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str):
        raise ConstraintError(f"constraint: the {instance.kind.name.lower()} text must be a string, got "
                              f"{type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ConstraintError(f"constraint: the {CONSTRAINT_KINDS[instance.kind].name} holds a lone surrogate at "
                              f"character {exc.start}; expected Unicode text") from None
    if size > MAX_CONSTRAINT_BYTES:
        raise ConstraintError(f"constraint: the {CONSTRAINT_KINDS[instance.kind].name} has {size} bytes; the limit "
                              f"is {MAX_CONSTRAINT_BYTES}")
    if instance.kind is ConstraintKind.JSON_OBJECT and value:
        raise ConstraintError("constraint: json_object takes no text")
    if instance.kind is not ConstraintKind.JSON_OBJECT and not value.strip():
        raise ConstraintError(f"constraint: the {CONSTRAINT_KINDS[instance.kind].name} is empty")


@attrs.frozen
class Constraint:
    """A session's constraint: its language and text (a JSON schema as compact JSON)."""

    kind: ConstraintKind = attrs.field(converter=ConstraintKind)
    text: str = attrs.field(default="", validator=_check_text)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool) -> Constraint:
        """Text matching a JSON schema (given parsed)."""
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object."""
        return cls(ConstraintKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Text matching a regular expression (Rust's `regex` syntax, anchored at both ends)."""
        return cls(ConstraintKind.REGEX, pattern)

    @classmethod
    def gbnf(cls, grammar: str) -> Constraint:
        """Text of a GBNF grammar (llama.cpp's syntax, rule `root`)."""
        return cls(ConstraintKind.GBNF, grammar)

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """Text of a Lark grammar in llguidance's dialect (rule `start`)."""
        return cls(ConstraintKind.LARK, grammar)

    @property
    def name(self) -> str:
        """The language's name (`json_schema`, `regex`, ...)."""
        return CONSTRAINT_KINDS[self.kind].name

    @functools.cached_property
    def digest(self) -> bytes:
        """What a compiled constraint is cached by: SHA-256 of the kind and the text."""
        return hashlib.sha256(bytes([self.kind]) + self.text.encode("utf-8")).digest()

    def grammar(self) -> str:
        """llguidance's grammar of this constraint; ConstraintError where the text is not one."""
        try:
            return CONSTRAINT_KINDS[self.kind].grammar(self.text)
        except ImportError:
            raise ConstraintError("constraints need the llguidance package; install skippy-zmq[model]") from None
        except (ValueError, TypeError) as exc:
            raise ConstraintError(f"{self.name}: {_one_line(str(exc))}") from None

    def check(self) -> None:
        """ConstraintError naming where the constraint is wrong (the JSON path, the grammar line),
        or what it asks that llguidance cannot enforce; without a tokenizer, so the gateway can check it."""
        if self.kind is ConstraintKind.JSON_SCHEMA:
            _check_schema(self.text)
        from llguidance import LLMatcher

        failed, messages = LLMatcher.validate_grammar_with_warnings(self.grammar())
        if failed:
            raise ConstraintError(f"{self.name}: {_explain(messages[0] if messages else 'not valid')}")


def _check_schema(text: str) -> None:
    """The schema is JSON and valid against its draft's meta-schema (Draft 2020-12 unless `$schema`
    says otherwise); ConstraintError naming the JSON path of the first fault."""
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise ConstraintError(f"json_schema: not JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"json_schema: a schema is an object or a boolean, got {type(schema).__name__}")
    try:
        import jsonschema
    except ImportError:  # llguidance's own check below still runs
        return
    # Without `$schema`, Draft 2020-12; a schema writing a tuple as an array of `items` (Drafts 4 to 7, as
    # pydantic v1 and older clients write them; 2020-12 spells it `prefixItems`) is read as Draft 7, as
    # llama-server and llguidance read it, rather than refused.
    default = jsonschema.Draft7Validator if _has_tuple_items(schema) else jsonschema.Draft202012Validator
    validator = jsonschema.validators.validator_for(schema, default=default)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ConstraintError(f"json_schema: {exc.json_path}: {_one_line(exc.message)}") from None


_VALUE_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # their values are data, not schemas


def _has_tuple_items(schema: object) -> bool:
    """Whether a subschema of `schema` (a decoded JSON schema) has `items` as an array."""
    if isinstance(schema, list):
        return any(_has_tuple_items(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    if isinstance(schema.get("items"), list):
        return True
    return any(_has_tuple_items(value) for key, value in schema.items() if key not in _VALUE_KEYWORDS)


def _explain(message: str) -> str:
    """llguidance's reason in one line, with what it means for an unimplemented keyword."""
    text = _one_line(message)
    if "Unimplemented keys" in text or "Unknown format" in text:
        return f"{text}: the constrained decoder cannot enforce this, so the schema is refused rather than ignored"
    return text


def _one_line(text: str, limit: int = 400) -> str:
    flat = " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
