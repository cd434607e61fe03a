"""Anthropic's Messages API (skippy_zmq.gateway.anthropic_api): the request as a chat request, the chat
answer as a Message, the chat stream as Anthropic's events (in-process, hypothesis for the stream's
shapes); the routes over the fake engine in-process; and one request of each kind through a real `serve`."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.errors import RemoteStageError, RequestError
from skippy_zmq.gateway.anthropic_api import MESSAGE_FIELDS, MessageStream, chat_body, error_body, message
from skippy_zmq.gateway.llama_api import read_json
from skippy_zmq.gateway.openai_api import ApiError, CompletionParams, Endpoint
from tests.gateway.fakes import FakeEngine, render_chat
from tests.gateway.test_http import make_backend, post, run_client
from tests.strategies import HOSTILE_TEXT, hostile_json

TOOL = {"name": "get_weather", "description": "The weather.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def body(**fields: Any) -> dict[str, Any]:
    return {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]} | fields


def refusal(given_body: Any, **options: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        chat_body(given_body, **options)
    return caught.value


# --- the request ---------------------------------------------------------------------------------


def test_a_plain_request_is_the_same_chat_request() -> None:
    chat = chat_body(body(system="Be brief.", temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["END"],
                          model="claude", metadata={"user_id": "u1"}, thinking={"type": "enabled",
                                                                                "budget_tokens": 1024}))
    assert chat == {"model": "claude", "temperature": 0.5, "top_p": 0.9, "top_k": 40, "max_tokens": 8,
                    "stop": ["END"], "messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "hi"}]}
    params = CompletionParams.from_body(Endpoint.CHAT, chat)  # chat's own validation takes it as it is
    assert (params.max_tokens, params.top_k, params.stop) == (8, 40, ("END",))


def test_blocks_become_chat_messages_in_chat_order() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": " it?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Look it up.", "signature": "sig"},
            {"type": "text", "text": "Let me see."},
            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        # Anthropic puts tool results first; chat wants them right after the calls, the user's text after
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": [{"type": "text", "text": "Sunny"}], "is_error": False},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ]
    chat = chat_body(body(messages=messages, system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]))
    assert chat["messages"] == [
        {"role": "system", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": " it?"}]},
        {"role": "assistant", "content": "Let me see.", "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]


def test_reasoning_content_only_where_there_was_thinking() -> None:
    chat = chat_body(body(messages=[{"role": "user", "content": "a"},
                                    {"role": "assistant", "content": [{"type": "text", "text": "b"}]}]))
    assert chat["messages"][1] == {"role": "assistant", "content": "b"}


@pytest.mark.parametrize(("choice", "fields"), [
    ({"type": "auto"}, {"tool_choice": "auto"}),
    ({"type": "any"}, {"tool_choice": "required"}),
    ({"type": "none"}, {"tool_choice": "none"}),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
     {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False}),
])
def test_tools_and_tool_choice(choice: dict[str, Any], fields: dict[str, Any]) -> None:
    chat = chat_body(body(tools=[TOOL], tool_choice=choice))
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather.", "parameters": TOOL["input_schema"]}}]
    assert {key: chat[key] for key in fields} == fields
    assert CompletionParams.from_body(Endpoint.CHAT, chat).tools is not None


def test_a_stream_asks_chat_for_the_usage() -> None:
    assert chat_body(body(stream=True))["stream_options"] == {"include_usage": True}


def test_count_tokens_needs_no_max_tokens_and_takes_no_sampling() -> None:
    assert chat_body({"messages": [{"role": "user", "content": "x"}]}, count_only=True) == {
        "messages": [{"role": "user", "content": "x"}]}
    assert refusal({"messages": [], "temperature": 1}, count_only=True).param == "temperature"


def test_an_empty_conversation_is_a_user_who_said_nothing() -> None:
    assert chat_body(body(messages=[]))["messages"] == [{"role": "user", "content": ""}]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


@pytest.mark.parametrize(("given_body", "param", "words"), [
    ({"max_tokens": 5}, "messages", "messages is required"),
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens", "max_tokens is required"),
    (body(max_tokens=0), "max_tokens", "max_tokens must be an integer >= 1"),
    (body(n=2), "n", "unknown field 'n'"),
    (body(messages=[{"role": "system", "content": "x"}]), "messages[0].role", "\"user\" or \"assistant\""),
    (body(messages=[{"role": "user", "content": [IMAGE]}]), "messages[0].content[0]", "image input is not supported"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": [IMAGE]}]}]),
     "messages[0].content[0].content[0]", "image input is not supported"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]),
     "messages[0].content[0].type", "in a user message"),
    (body(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": 3}]}]),
     "messages[0].content[0].input", "must be an object"),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type", "server tool"),
    (body(tools=[{"name": "f"}]), "tools[0].input_schema", "is required"),
    (body(tool_choice={"type": "sometimes"}), "tool_choice.type", "\"auto\", \"any\", \"tool\" or \"none\""),
    (body(stop_sequences=["a", "b", "c", "d", "e"]), "stop_sequences", "at most 4"),
    (body(thinking={"type": "enabled"}), "thinking.budget_tokens", "integer"),
    (body(system=[{"type": "text"}]), "system[0].text", "must be a string"),
    ([], None, "must be a JSON object"),
])
def test_refusals_name_the_anthropic_field(given_body: Any, param: str | None, words: str) -> None:
    error = refusal(given_body)
    assert (error.status, error.param) == (400, param)
    assert words in error.message


_ANY = st.none() | st.booleans() | st.integers(-1, 3) | HOSTILE_TEXT | st.just({}) | st.just([])
BLOCKS = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "thinking", "tool_use", "tool_result", "image", "redacted_thinking", "x"])},
    optional={"text": HOSTILE_TEXT | _ANY, "thinking": HOSTILE_TEXT | _ANY, "id": HOSTILE_TEXT | _ANY,
              "name": HOSTILE_TEXT, "input": st.dictionaries(HOSTILE_TEXT, HOSTILE_TEXT, max_size=2) | _ANY,
              "tool_use_id": HOSTILE_TEXT | _ANY, "is_error": _ANY,
              "content": HOSTILE_TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": HOSTILE_TEXT}),
                                                 max_size=2) | _ANY})
TURNS = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                        "content": HOSTILE_TEXT | st.lists(BLOCKS, max_size=3) | _ANY}), max_size=4)


@given(hostile_json(sorted(MESSAGE_FIELDS), {"messages": TURNS, "max_tokens": st.integers(0, 9)}, extra=2)
       | hostile_json(sorted(MESSAGE_FIELDS)))
@settings(max_examples=300, deadline=None)
def test_any_hostile_body_is_a_chat_request_or_a_400(data: bytes) -> None:
    try:
        params = CompletionParams.from_body(Endpoint.CHAT, chat_body(read_json(data)))
        render_chat(params.messages)  # chat's message checks: a RequestError is the route's 400
    except (ApiError, RequestError) as error:
        assert not isinstance(error, ApiError) or error.status == 400
        return
    assert params.messages and params.max_tokens is not None


@pytest.mark.parametrize(("status", "kind"), [(400, "invalid_request_error"), (401, "authentication_error"),
                                              (404, "not_found_error"), (413, "request_too_large"),
                                              (429, "rate_limit_error"), (503, "overloaded_error"),
                                              (504, "timeout_error"), (415, "invalid_request_error"),
                                              (500, "api_error"), (502, "api_error")])
def test_error_bodies_are_anthropic_s(status: int, kind: str) -> None:
    assert error_body(ApiError(status, "what went wrong")) == {
        "type": "error", "error": {"type": kind, "message": "what went wrong"}}


# --- the answer ----------------------------------------------------------------------------------


def chat_answer(message_fields: dict[str, Any], finish: str = "stop", cached: int = 0) -> dict[str, Any]:
    usage: dict[str, Any] = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"id": "chatcmpl-abc123", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", **message_fields}, "logprobs": None,
                         "finish_reason": finish}], "usage": usage}


def test_a_whole_answer_is_a_message() -> None:
    answer = chat_answer({"content": "Hello", "reasoning_content": "Greet.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}, "tool_calls", 6)
    assert message(answer) == {
        "id": "msg_abc123", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "thinking", "thinking": "Greet.", "signature": ""}, {"type": "text", "text": "Hello"},
                    {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 6,
                  "output_tokens": 4}}


@pytest.mark.parametrize(("finish", "stop", "reason"), [("stop", "", "end_turn"), ("stop", "END", "stop_sequence"),
                                                        ("length", "", "max_tokens")])
def test_stop_reasons(finish: str, stop: str, reason: str) -> None:
    answered = message(chat_answer({"content": "x"}, finish), stop_sequence=stop)
    assert (answered["stop_reason"], answered["stop_sequence"]) == (reason, stop or None)


def test_an_answer_that_says_nothing_is_one_empty_text_block() -> None:
    assert message(chat_answer({"content": ""}))["content"] == [{"type": "text", "text": ""}]


# --- the stream ----------------------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-abc123", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], "usage": None}


def call_deltas(index: int, name: str, pieces: list[str]) -> list[dict[str, Any]]:
    head = {"tool_calls": [{"index": index, "id": f"call_{index}", "type": "function",
                            "function": {"name": name, "arguments": ""}}]}
    return [head, *({"tool_calls": [{"index": index, "function": {"arguments": piece}}]} for piece in pieces)]


# A chat stream's deltas in the order chat sends them: reasoning, then content, then each call whole.
texts = st.lists(st.text(min_size=1, max_size=5), max_size=4)
streams = st.tuples(texts, texts, st.lists(st.lists(st.sampled_from(['{"a"', ":", "1}"]), max_size=3), max_size=3))


def fed(reasoning: list[str], content: list[str], calls: list[list[str]],
        finish: str = "stop") -> list[tuple[str, dict[str, Any]]]:
    deltas = [{"reasoning_content": t} for t in reasoning] + [{"content": t} for t in content]
    for index, pieces in enumerate(calls):
        deltas += call_deltas(index, f"f{index}", pieces)
    stream = MessageStream("chatcmpl-abc123", "m", 10)
    events = stream.start()
    for delta in [{"role": "assistant", "content": None}, *deltas]:
        events += stream.feed(chunk(delta))
    events += stream.feed(chunk({}, "tool_calls" if calls else finish))
    events += stream.feed({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 3}})
    return events + stream.finish()


def assembled(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The content blocks a client puts together from the events, checking their order and indices."""
    blocks: list[dict[str, Any]] = []
    open_index = None
    for name, data in events:
        assert data["type"] == name
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)  # one open at a time, numbered from 0
            open_index = data["index"]
            blocks.append(dict(data["content_block"]) | ({"partial": ""} if data["content_block"]["type"] ==
                                                         "tool_use" else {}))
        elif name == "content_block_delta":
            assert data["index"] == open_index
            delta, block = data["delta"], blocks[open_index]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial",
                   "signature_delta": "signature"}[delta["type"]]
            block[key] = block.get(key, "") + delta[{"input_json_delta": "partial_json"}.get(delta["type"], key)]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert open_index is None
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block.pop("partial") or "{}")
    return blocks


@given(streams)
def test_a_stream_s_blocks_are_the_whole_answer_s(stream: tuple[list[str], list[str], list[list[str]]]) -> None:
    reasoning, content, calls = stream
    calls = [pieces for pieces in calls if pieces in ([], ['{"a"', ":", "1}"])]  # whole JSON, or none yet
    events = fed(reasoning, content, calls)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == 10
    tool_calls = [{"id": f"call_{i}", "type": "function",
                   "function": {"name": f"f{i}", "arguments": "".join(pieces)}} for i, pieces in enumerate(calls)]
    whole = message(chat_answer({"content": "".join(content), "reasoning_content": "".join(reasoning),
                                 "tool_calls": tool_calls}, "tool_calls" if calls else "stop"))
    assert assembled(events) == whole["content"]
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == whole["stop_reason"]
    assert delta["usage"]["output_tokens"] == 3


def test_a_stream_with_a_stop_string_names_it() -> None:
    stream = MessageStream("chatcmpl-x", "m", 3)
    events = stream.start() + stream.feed(chunk({"content": "a"})) + stream.feed(chunk({}, "stop"))
    delta = (events + stream.finish("END"))[-2][1]["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_a_failure_is_anthropic_s_error_event() -> None:
    assert MessageStream("chatcmpl-x", "m", 3).failed(ApiError(504, "too slow")) == [
        ("error", {"type": "error", "error": {"type": "timeout_error", "message": "too slow"}})]


# --- the routes, over the fake engine ------------------------------------------------------------


def sse_named(raw: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.split("\n\n"):
        if block:
            name_line, data_line = block.split("\n")
            events.append((name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))))
    return events


def test_the_routes_answer_in_anthropic_s_shapes() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        # the fake engine does not stop at stop strings (the real one does, through serve below): it gets them
        status, _, answer = await post(client, "/v1/messages", body(max_tokens=3, stop_sequences=[" w9"]))
        assert status == 200 and answer["content"] == [{"type": "text", "text": " w0 w1 w2"}]
        assert answer["usage"]["output_tokens"] == 3 and answer["id"].startswith("msg_")
        response = await client.post("/v1/messages", json=body(max_tokens=2, stream=True))
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
        events = sse_named(await response.text())
        assert [name for name, _ in events] == ["message_start", "content_block_start", "content_block_delta",
                                                "content_block_delta", "content_block_stop", "message_delta",
                                                "message_stop"]
        assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
        status, _, counted = await post(client, "/v1/messages/count_tokens", {"messages": [
            {"role": "user", "content": "four"}]})
        assert (status, counted) == (200, {"input_tokens": 5})  # BOS and four bytes
        status, _, error = await post(client, "/v1/messages", {"messages": []})
        assert status == 400 and error == {"type": "error", "error": {"type": "invalid_request_error",
                                                                      "message": "max_tokens is required"}}
        status, _, error = await post(client, "/v1/messages", body(temperature=3))
        assert status == 400 and error["error"]["message"].startswith("temperature must be")  # chat's check

    run_client(make_backend(engine), scenario)
    assert engine.submitted[0].request.stop == (" w9",)


def test_a_failure_mid_stream_is_an_error_event_and_a_whole_one_anthropic_s_error() -> None:
    engine = FakeEngine()
    engine.failure, engine.fail_after = RemoteStageError("stage 1 failed"), 1

    async def scenario(client: TestClient[Any, Any]) -> None:
        response = await client.post("/v1/messages", json=body(max_tokens=5, stream=True))
        events = sse_named(await response.text())
        assert [name for name, _ in events] == ["message_start", "content_block_start", "content_block_delta",
                                                "error"]
        assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "stage 1 failed"}}
        status, _, error = await post(client, "/v1/messages", body(max_tokens=5))
        assert (status, error["error"]["type"]) == (500, "api_error")

    run_client(make_backend(engine), scenario)


def test_anthropic_s_routes_refuse_a_missing_key_in_anthropic_s_shape() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, error = await post(client, "/v1/messages", body())
        assert status == 401 and error["type"] == "error" and error["error"]["type"] == "authentication_error"
        response = await client.post("/v1/messages", json=body(max_tokens=1), headers={"X-Api-Key": "k"})
        assert response.status == 200

    run_client(make_backend(FakeEngine()), scenario, api_key="k")


# --- through a real serve ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_real_serve_answers_messages_streams_and_tool_use(tiny_serve: Any) -> None:  # tests/gateway/conftest.py
    pytest.importorskip("llguidance")
    import requests

    url = tiny_serve.url
    whole = requests.post(f"{url}/v1/messages", json=body(max_tokens=6, temperature=0), timeout=120).json()
    stream = requests.post(f"{url}/v1/messages", json=body(max_tokens=6, temperature=0, stream=True), timeout=120)
    streamed = assembled(sse_named(stream.text)[1:-2])
    assert streamed == whole["content"] and whole["usage"]["output_tokens"] >= 1
    bounded = TOOL | {"input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                                       "properties": {"city": {"type": "string", "maxLength": 12}}}}
    called = requests.post(f"{url}/v1/messages", timeout=120, json=body(
        max_tokens=400, tools=[bounded], tool_choice={"type": "tool", "name": "get_weather"})).json()
    uses = [block for block in called["content"] if block["type"] == "tool_use"]
    assert called["stop_reason"] == "tool_use" and uses[0]["name"] == "get_weather"
    assert isinstance(uses[0]["input"]["city"], str)
