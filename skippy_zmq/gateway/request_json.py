"""The JSON of a request, an HTTP body or a ZeroMQ request frame, read with the two rules Python's
`json` lacks (docs/PROTOCOL.md §8.1, §9.3); socket-free.

- Integers: Python converts an integer literal of more than 4,300 digits only with a ValueError
  (the conversion takes time quadratic in the digits). Such a literal becomes an
  `OversizedInteger` instead, which no field's bounds accept, so the error names the field.
- Text: a JSON `\\ud800` escape can write a lone surrogate, which is not Unicode text and which
  no UTF-8 encoder takes (the tokenizer refuses it, and so would every answer that echoes it). A
  document with one, as a key or in a value at any depth, is refused naming where it is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import attrs

from skippy_zmq.errors import RequestJsonError

MAX_INTEGER_DIGITS = 4300
"""Longest integer literal converted to an int: Python's own default limit (sys.int_info)."""
# Only these escapes write a surrogate; a document without one needs no walk.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


@attrs.frozen(repr=False)
class OversizedInteger:
    """A JSON integer literal too long to convert: only its sign and number of digits are kept."""

    digits: int
    negative: bool = False

    def __repr__(self) -> str:
        """How error messages show it, e.g. `an integer of 5000 digits`."""
        return f"{'a negative' if self.negative else 'an'} integer of {self.digits} digits"


def _integer(literal: str) -> int | OversizedInteger:
    negative = literal.startswith("-")
    digits = len(literal) - negative
    return OversizedInteger(digits, negative) if digits > MAX_INTEGER_DIGITS else int(literal)


@attrs.frozen
class RequestJson:
    """A request's parsed JSON and, if it holds one, where its first lone surrogate is."""

    value: Any
    invalid_text: RequestJsonError | None = None

    @classmethod
    def parse(cls, data: bytes, what: str) -> RequestJson:
        """Parse `data`, the `what` ("request body", "request frame"); RequestJsonError (param
        None) when it is not UTF-8 JSON. Lone surrogates are found here and raised by `checked`."""
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise RequestJsonError(f"the {what} is not UTF-8 JSON: byte {exc.start} "
                                   f"({data[exc.start:exc.start + 1]!r}) is not UTF-8") from None
        try:
            value = _loads(text)
        except json.JSONDecodeError as exc:
            raise RequestJsonError(f"the {what} is not UTF-8 JSON: {exc}") from None
        except RecursionError:
            raise RequestJsonError(f"the {what} nests JSON too deeply") from None
        fault = None if _SURROGATE_ESCAPE.search(text) is None else _first_lone_surrogate(value)
        return cls(value, fault)

    def checked(self) -> Any:
        """The value; RequestJsonError naming the field when a text in it is not valid Unicode."""
        if self.invalid_text is not None:
            raise self.invalid_text
        return self.value


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError:  # an integer literal above Python's limit: parse again, keeping such literals unconverted
        return json.loads(text, parse_int=_integer)


def is_text(value: str) -> bool:
    """Whether `value` is Unicode text (UTF-8 encodable: no lone surrogate)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def shown(text: str) -> str:
    """`text` with every lone surrogate written as its escape, safe to put in a message or a `param`."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _first_lone_surrogate(document: Any) -> RequestJsonError | None:
    """The error naming the first key or string holding a lone surrogate, depth first; None if none.
    Iterative: a document that `json` parsed may nest deeper than Python's stack allows here."""
    stack: list[tuple[Any, str]] = [(document, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not is_text(value):
                return _invalid(path or "the document", value, path or None)
        elif isinstance(value, dict):
            items = list(value.items())
            for key, item in reversed(items):
                where = f"{path}.{shown(key)}" if path else shown(key)
                if not is_text(key):
                    return _invalid(f"the field name {key!r}", key, where)
                stack.append((item, where))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{index}]") for index, item in reversed(list(enumerate(value))))
    return None


def _invalid(subject: str, text: str, param: str | None) -> RequestJsonError:
    index = next(i for i, char in enumerate(text) if not is_text(char))
    return RequestJsonError(
        f"{subject} is not valid Unicode text: it holds a lone surrogate ({shown(text[index])} at index {index}); "
        "a \\u escape must name a character or one half of a surrogate pair followed by the other",
        param=param,
    )

def json_kind(value: object) -> str:
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
