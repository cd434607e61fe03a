"""Tests of skippy_zmq.gateway.request_json: integers too long to convert, lone surrogates named
where they are, and what is not UTF-8 JSON."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings

from skippy_zmq.errors import RequestError, RequestJsonError
from skippy_zmq.gateway.request_json import MAX_INTEGER_DIGITS, OversizedInteger, RequestJson, is_text, shown
from tests.strategies import hostile_json


def parsed(data: bytes) -> Any:
    return RequestJson.parse(data, "request body").checked()


def invalid_text(data: bytes) -> RequestJsonError:
    document = RequestJson.parse(data, "request body")
    with pytest.raises(RequestJsonError) as caught:
        document.checked()
    return caught.value


def test_integers_up_to_the_limit_are_ints_and_longer_ones_are_not_converted() -> None:
    limit = "9" * MAX_INTEGER_DIGITS
    assert parsed(f'{{"a": {limit}, "b": -{limit}}}'.encode()) == {"a": int(limit), "b": -int(limit)}
    value = parsed(b'{"max_tokens": ' + b"9" * 5000 + b', "seed": -' + b"1" * 4301 + b', "n": 3}')
    assert value == {"max_tokens": OversizedInteger(5000), "seed": OversizedInteger(4301, negative=True), "n": 3}
    assert repr(value["max_tokens"]) == "an integer of 5000 digits"
    assert repr(value["seed"]) == "a negative integer of 4301 digits"


def test_an_oversized_integer_is_no_number_a_field_accepts() -> None:
    huge = OversizedInteger(5000)
    assert not isinstance(huge, (int, float))
    assert huge not in (0, 1)


@pytest.mark.parametrize(("data", "param", "subject"), [
    (b'{"prompt": "a\\ud800b"}', "prompt", "prompt"),
    (b'{"prompt": ["ok", "\\udfff"]}', "prompt[1]", "prompt[1]"),
    (b'{"messages": [{"role": "user", "content": "x\\udc00"}]}', "messages[0].content", "messages[0].content"),
    (b'{"a\\ud800b": 1}', "a\\ud800b", "the field name 'a\\ud800b'"),
    (b'{"metadata": {"k": {"\\ud83d": []}}}', "metadata.k.\\ud83d", "the field name '\\ud83d'"),
    (b'"\\ud800"', None, "the document"),
])
def test_a_lone_surrogate_is_refused_naming_where_it_is(data: bytes, param: str | None, subject: str) -> None:
    error = invalid_text(data)
    assert isinstance(error, RequestError)  # a 400 of the request, by class
    assert error.param == param
    assert str(error).startswith(f"{subject} is not valid Unicode text: it holds a lone surrogate")
    str(error).encode("utf-8")  # the message itself is valid text, safe to answer with
    assert error.param is None or is_text(error.param)


def test_the_first_surrogate_depth_first_and_the_index_in_the_text() -> None:
    error = invalid_text(b'{"stop": ["fine", "ab\\udc01"], "user": "\\ud800"}')
    assert (error.param, "(\\udc01 at index 2)" in str(error)) == ("stop[1]", True)


def test_surrogate_pairs_and_escaped_backslashes_are_text() -> None:
    assert parsed(b'{"prompt": "\\ud83d\\ude00", "user": "\\\\ud800"}') == {"prompt": "\U0001f600", "user": "\\ud800"}


def test_a_deep_document_is_walked_without_recursion() -> None:
    depth = 900  # json parses it; a recursive walk called 400 frames down would pass Python's limit of 1000
    document = RequestJson.parse(b'{"a":' * depth + b'"\\ud800"' + b"}" * depth, "request body")

    def down(frames: int) -> None:
        if frames:
            down(frames - 1)
        else:
            document.checked()

    with pytest.raises(RequestJsonError) as caught:
        down(400)
    assert caught.value.param == ".".join(["a"] * depth)


@pytest.mark.parametrize(("data", "message"), [
    (b"\xff\xfe{}", "the request body is not UTF-8 JSON: byte 0 (b'\\xff') is not UTF-8"),
    (b"{not json", "the request body is not UTF-8 JSON: Expecting property name"),
    (b"[" * 200_000, "the request body nests JSON too deeply"),
])
def test_what_is_not_utf8_json(data: bytes, message: str) -> None:
    with pytest.raises(RequestJsonError) as caught:
        RequestJson.parse(data, "request body")
    assert str(caught.value).startswith(message)
    assert caught.value.param is None


def test_a_utf8_byte_order_mark_is_allowed() -> None:
    assert parsed(b'\xef\xbb\xbf{"prompt": "x"}') == {"prompt": "x"}


def test_is_text_and_shown() -> None:
    assert is_text("plain") and is_text("é\U0001f600")
    assert not is_text("a\ud800") and not is_text("\ud83d\ude00")  # a pair inside a str is two lone halves
    assert shown("a\ud800b") == "a\\ud800b" and shown("é") == "é"


@given(hostile_json(["prompt", "messages", "content", "id"]))
@settings(max_examples=300, deadline=None)
def test_any_document_parses_or_is_refused_with_text_that_can_be_sent(data: bytes) -> None:
    try:
        value = parsed(data)
    except RequestJsonError as error:
        str(error).encode("utf-8")
        assert error.param is None or is_text(error.param)
        return
    json.dumps(value, ensure_ascii=False, default=repr).encode("utf-8")  # every text in it is valid
