"""Tests of skippy_zmq.gateway.cors: which origins may call the API from a browser, and the headers."""

from __future__ import annotations

import pytest

from skippy_zmq.errors import ConfigError
from skippy_zmq.gateway.cors import ALLOWED_METHODS, DEFAULT_HEADERS, MAX_AGE_S, CorsPolicy

PAGE = "http://localhost:5173"


def test_no_origin_is_allowed_by_default() -> None:
    for policy in (CorsPolicy(), CorsPolicy.parse(None), CorsPolicy.parse(""), CorsPolicy.parse(" , ")):
        assert not policy.enabled and not policy.allows(PAGE)
        assert policy.preflight(PAGE, "content-type") == {} and policy.headers_for(PAGE) == {}


def test_listed_origins_match_as_browsers_send_them() -> None:
    policy = CorsPolicy.parse("http://localhost:5173/, https://App.Example.com")
    assert policy.allows(PAGE) and policy.allows("https://app.example.com")
    assert not policy.allows("http://localhost:5174") and not policy.allows("https://evil.example")
    assert not policy.allows(None) and not policy.allows("null")
    assert policy.headers_for("https://app.example.com") == {"Access-Control-Allow-Origin": "https://app.example.com",
                                                             "Vary": "Origin"}
    assert policy.headers_for("https://evil.example") == {}


def test_any_origin_reflects_the_origin_itself() -> None:
    policy = CorsPolicy.parse("*")
    assert policy.headers_for("https://anything.test")["Access-Control-Allow-Origin"] == "https://anything.test"
    assert policy.headers_for(None) == {}


def test_a_preflight_allows_the_asked_headers_or_the_defaults() -> None:
    policy = CorsPolicy.parse(PAGE)
    headers = policy.preflight(PAGE, "authorization, content-type, x-stainless-os")
    assert headers == {"Access-Control-Allow-Origin": PAGE, "Vary": "Origin",
                       "Access-Control-Allow-Methods": ALLOWED_METHODS,
                       "Access-Control-Allow-Headers": "authorization, content-type, x-stainless-os",
                       "Access-Control-Max-Age": str(MAX_AGE_S)}
    for asked in (None, "", "bad header\r\nx: y", "a;b", "x" * 2000):
        assert policy.preflight(PAGE, asked)["Access-Control-Allow-Headers"] == DEFAULT_HEADERS
    assert policy.preflight("https://other.test", "content-type") == {}


def test_a_preflight_is_an_options_request_with_origin_and_request_method() -> None:
    assert CorsPolicy.is_preflight("OPTIONS", PAGE, "POST")
    assert not CorsPolicy.is_preflight("OPTIONS", PAGE, None)
    assert not CorsPolicy.is_preflight("OPTIONS", None, "POST")
    assert not CorsPolicy.is_preflight("POST", PAGE, "POST")


@pytest.mark.parametrize("entry", ["localhost:5173", "ftp://host", "http://", "http://a b", "http://h:123456",
                                   "http://host/path"])
def test_an_entry_that_is_not_an_origin_is_refused_naming_it(entry: str) -> None:
    with pytest.raises(ConfigError, match="--cors-origins") as caught:
        CorsPolicy.parse(f"{PAGE},{entry}")
    assert repr(entry.strip().rstrip("/").lower()) in str(caught.value)
