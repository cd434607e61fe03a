"""skippy_zmq.gateway.tool_calls: the request's tools validated, call ids, the JSON scanner."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skippy_zmq.errors import RequestError
from skippy_zmq.gateway.tool_calls import CallIds, Tools, compact_json, scan_json

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tools_parse_with_choice_and_parallel() -> None:
    tools = Tools.from_request([WEATHER, {"type": "function", "function": {"name": "noop"}}],
                               {"type": "function", "function": {"name": "noop"}}, False)
    assert tools.names == {"get_weather", "noop"}
    assert tools.choice == "noop" and not tools.parallel
    assert [s.name for s in tools.allowed()] == ["noop"]
    assert tools.specs[1].parameters == {"type": "object", "properties": {}}  # as llama-server fills it
    assert tools.as_template_json()[0] == {"type": "function", "function": {
        "name": "get_weather", "description": "Weather", "parameters": WEATHER["function"]["parameters"]}}
    assert Tools.from_request([WEATHER]).choice == "auto"


@pytest.mark.parametrize(("tools", "choice", "message"), [
    ("x", None, "tools: must be a list"),
    ([{"type": "retrieval"}], None, r"tools\[0\]\.type: 'retrieval'"),
    ([WEATHER, {"type": "function", "function": {"name": "a b"}}], None, r"tools\[1\]\.function\.name: 'a b'"),
    ([WEATHER, WEATHER], None, r"tools\[1\]\.function\.name: 'get_weather' names two tools"),
    ([WEATHER, WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], None,
     r"tools\[2\]\.function\.parameters\.type: not a valid JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None,
     r"tools\[0\]\.function\.parameters: must be a JSON schema object"),
    ([WEATHER], "sometimes", "tool_choice: 'sometimes' is not supported"),
    ([WEATHER], {"type": "function", "function": {"name": "other"}}, "tool_choice.function.name: 'other' is not one"),
])
def test_bad_tools_are_request_errors_naming_the_field(tools: Any, choice: Any, message: str) -> None:
    if isinstance(tools, list) and len(tools) == 3:
        tools = [WEATHER, {"type": "function", "function": {"name": "g"}}, tools[2]]
    with pytest.raises(RequestError, match=message):
        Tools.from_request(tools, choice)


def test_call_ids_are_random_or_repeatable() -> None:
    first, second = CallIds().next(), CallIds().next()
    assert first.startswith("call_") and len(first) == 29 and first[5:].isalnum() and first != second
    assert CallIds(seed=3).next() == CallIds(seed=3).next()
    assert len(CallIds(prefix="", length=9).next()) == 9


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(), lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                    max_leaves=8)


@given(JSON, st.sampled_from([None, 2]), st.data())
def test_scan_writes_any_value_compact_and_each_prefix_as_a_prefix(value: Any, indent: int | None,
                                                                   data: st.DataObject) -> None:
    text = json.dumps({"v": value}, indent=indent, ensure_ascii=data.draw(st.booleans()))
    whole = scan_json(text, 0, {(): "all"}.get)
    assert whole.end == len(text) and not whole.error
    assert whole.captured["all"] == compact_json({"v": value})
    cut = data.draw(st.integers(0, len(text)))
    part = scan_json(text[:cut], 0, {(): "all"}.get)
    assert not part.error
    assert whole.captured["all"].startswith(part.captured.get("all", ""))


@pytest.mark.parametrize("text", ['{"a": 1,}', '{"a" 1}', "[1 2]", '{"a": tru}', "}", '{"a": "x"]'])
def test_scan_finds_broken_json(text: str) -> None:
    assert scan_json(text, 0, lambda _: None).error
