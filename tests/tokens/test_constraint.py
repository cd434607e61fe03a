"""Constraints as values: one row per language, checked without a tokenizer, naming where they fail."""

from __future__ import annotations

import json

import pytest

from skippy_zmq.tokens.constraint import (
    CONSTRAINT_KINDS,
    MAX_CONSTRAINT_BYTES,
    Constraint,
    ConstraintError,
    ConstraintKind,
)

pytest.importorskip("llguidance")


@pytest.mark.parametrize("constraint", [
    Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    Constraint.json_schema(True),
    Constraint.json_object(),
    Constraint.regex(r"[a-z]+@[a-z]+\.com"),
    Constraint.gbnf('root ::= "yes" | "no"'),
    Constraint.gbnf('root ::= item ("," item)*\nitem ::= [0-9]+\n'),
    Constraint.lark('start: "a"+ NUMBER\nNUMBER: /[0-9]+/\n'),
    # a tuple as an array of items (Drafts 4 to 7, pydantic v1) without $schema: read as Draft 7
    Constraint.json_schema({"type": "object", "properties": {"p": {"items": [{"type": "integer"}],
                                                                   "additionalItems": False}}}),
])
def test_valid_constraints_pass_the_check(constraint: Constraint) -> None:
    constraint.check()
    assert constraint.grammar()


@pytest.mark.parametrize(("constraint", "match"), [
    (Constraint.json_schema({"type": "integr"}), r"\$\.type: 'integr' is not valid"),
    (Constraint.json_schema({"properties": {"a": {"minimum": "x"}}}), r"\$\.properties\.a\.minimum: 'x' is not of type"),
    (Constraint(ConstraintKind.JSON_SCHEMA, "{not json"), "not JSON"),
    (Constraint(ConstraintKind.JSON_SCHEMA, "[1, 2]"), "a schema is an object or a boolean, got list"),
    (Constraint.json_schema({"type": "array", "uniqueItems": True}), r"uniqueItems.*cannot enforce"),
    (Constraint.json_schema({"not": {"type": "string"}}), r"\"not\".*cannot enforce"),
    (Constraint.json_schema({"type": "string", "format": "no-such-format"}), "Unknown format: no-such-format"),
    (Constraint.json_schema({"$ref": "http://example.com/s.json"}), "http://example.com/s.json"),
    # an array of items under a declared Draft 2020-12 is wrong there; a list in `enum` is data, not a tuple
    (Constraint.json_schema({"$schema": "https://json-schema.org/draft/2020-12/schema", "items": [True]}),
     r"\$\.items: \[True\] is not of type"),
    (Constraint.json_schema({"enum": [{"items": [1]}], "items": 3}), r"\$\.items: 3 is not of type"),
    (Constraint.regex("[a-z"), "unclosed character class"),
    (Constraint.gbnf("root ::= missing"), "Rule 'missing' not found"),
    (Constraint.gbnf('root ::= "a" |\n bad ::= '), "line 2"),
    (Constraint.lark('start: "a" b\n'), 'unknown name: "b"'),
])
def test_a_bad_constraint_is_refused_naming_where(constraint: Constraint, match: str) -> None:
    with pytest.raises(ConstraintError, match=match):
        constraint.check()


@pytest.mark.parametrize(("kind", "text", "match"), [
    (ConstraintKind.JSON_OBJECT, "{}", "json_object takes no text"),
    (ConstraintKind.REGEX, "  ", "the regex is empty"),
    (ConstraintKind.GBNF, "x" * (MAX_CONSTRAINT_BYTES + 1), f"the limit is {MAX_CONSTRAINT_BYTES}"),
    (ConstraintKind.LARK, "start: \ud800", "lone surrogate at character 7"),
    (ConstraintKind.LARK, b"start", "must be a string, got bytes"),
])
def test_the_value_refuses_what_cannot_travel(kind: ConstraintKind, text: object, match: str) -> None:
    with pytest.raises(ConstraintError, match=match):
        Constraint(kind, text)  # type: ignore[arg-type]


def test_every_kind_has_a_distinct_name_and_the_digest_tells_kinds_apart() -> None:
    assert len({row.name for row in CONSTRAINT_KINDS.values()}) == len(ConstraintKind)
    assert Constraint.regex("a").digest != Constraint.lark("a").digest
    assert Constraint.regex("a").digest == Constraint.regex("a").digest != Constraint.regex("b").digest


def test_a_schema_travels_as_compact_json() -> None:
    schema = {"type": "object", "properties": {"é": {"type": "string"}}}
    constraint = Constraint.json_schema(schema)
    assert json.loads(constraint.text) == schema and " " not in constraint.text and "é" in constraint.text
