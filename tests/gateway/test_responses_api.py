"""OpenAI's Responses API (skippy_zmq.gateway.responses_api): the request as a chat request, the chat
answer as a Response, the chat stream as the Responses events (in-process, hypothesis for the stream's
shapes); the routes through the `openai` package over the fake engine; and one real `serve`."""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.errors import RemoteStageError, RequestError
from skippy_zmq.gateway.llama_api import read_json
from skippy_zmq.gateway.openai_api import ApiError, CompletionParams, Endpoint
from skippy_zmq.gateway.responses_api import OWN_FIELDS, PASSED_FIELDS, ResponsesRequest, ResponseStream, response
from tests.gateway.fakes import FakeEngine, render_chat
from tests.gateway.test_http import make_backend, openai_client, post, run_client
from tests.strategies import HOSTILE_TEXT, hostile_json

FUNCTION = {"type": "function", "name": "get_weather", "description": "The weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def chat_of(**fields: Any) -> dict[str, Any]:
    return ResponsesRequest.from_body({"input": "hi"} | fields).chat


def refusal(body: Any) -> ApiError:
    with pytest.raises(ApiError) as caught:
        ResponsesRequest.from_body(body)
    return caught.value


# --- the request ---------------------------------------------------------------------------------


def test_a_plain_request_is_the_same_chat_request() -> None:
    chat = chat_of(instructions="Be brief.", max_output_tokens=8, temperature=0.5, top_p=0.9, model="gpt-4.1",
                   top_k=40, seed=3, store=False, reasoning={"effort": "low"}, include=[], truncation="disabled")
    assert chat == {"model": "gpt-4.1", "temperature": 0.5, "top_p": 0.9, "store": False, "top_k": 40, "seed": 3,
                    "max_tokens": 8, "messages": [{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "hi"}]}
    params = CompletionParams.from_body(Endpoint.CHAT, chat)
    assert (params.max_tokens, params.top_k, params.seed) == (8, 40, 3)


def test_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather"},
                                                        {"type": "input_text", "text": " in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"type": "message", "role": "assistant", "content": "It is sunny."},
    ]
    assert chat_of(input=items)["messages"] == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "Call.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "assistant", "content": "It is sunny."},
    ]


def test_tools_tool_choice_and_text_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_of(tools=[FUNCTION], tool_choice={"type": "function", "name": "get_weather"},
                   text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}})
    assert chat["tools"] == [{"type": "function", "function": {k: FUNCTION[k] for k in
                                                               ("name", "description", "parameters")}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "out", "schema": schema, "strict": True}}
    assert chat_of(text={"format": {"type": "json_object"}})["response_format"] == {"type": "json_object"}
    assert CompletionParams.from_body(Endpoint.CHAT, chat_of(tools=[FUNCTION], tool_choice="required")).tools


IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}


@pytest.mark.parametrize(("body", "param", "words"), [
    ({}, "input", "input is required"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "an integer >= 1"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"input": "x", "background": True}, "background", "only false"),
    ({"input": "x", "messages": []}, "messages", "unknown field 'messages'"),
    ({"input": [{"role": "user", "content": [IMAGE]}]}, "input[0].content[0]", "image input is not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "item_reference"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "must be one of"),
    ({"input": 3}, "input", "must be a list"),
    ({"input": []}, "input", "holds no items"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "hosted tools"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice must be"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}, "extra": 1}}}, "text.format.extra",
     "unknown field"),
])
def test_refusals_name_the_responses_field(body: Any, param: str, words: str) -> None:
    error = refusal(body)
    assert (error.status, error.param) == (400, param)
    assert words in error.message


_ANY = st.none() | st.booleans() | st.integers(-1, 3) | HOSTILE_TEXT | st.just({}) | st.just([])
_PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "refusal",
                                                                  "input_image", "x"])},
                                        optional={"text": HOSTILE_TEXT | _ANY, "refusal": HOSTILE_TEXT}), max_size=2)
ITEMS = st.lists(st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference"]),
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
    "content": HOSTILE_TEXT | _PARTS | _ANY, "call_id": HOSTILE_TEXT | _ANY, "name": HOSTILE_TEXT | _ANY,
    "arguments": HOSTILE_TEXT | _ANY, "output": HOSTILE_TEXT | _PARTS | _ANY, "summary": _PARTS | _ANY}), max_size=4)
KEYS = sorted(OWN_FIELDS | set(PASSED_FIELDS))


@given(hostile_json(KEYS, {"input": ITEMS}, extra=2) | hostile_json(KEYS))
@settings(max_examples=300, deadline=None)
def test_any_hostile_body_is_a_chat_request_or_a_400(data: bytes) -> None:
    try:
        params = CompletionParams.from_body(Endpoint.CHAT, ResponsesRequest.from_body(read_json(data)).chat)
        render_chat(params.messages)  # chat's message checks: a RequestError is the route's 400
    except (ApiError, RequestError) as error:
        assert not isinstance(error, ApiError) or error.status == 400
        return
    assert params.messages


# --- the answer ----------------------------------------------------------------------------------


def chat_answer(message_fields: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {"id": "chatcmpl-abc", "object": "chat.completion", "created": 7, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", **message_fields}, "logprobs": None,
                         "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                      "prompt_tokens_details": {"cached_tokens": 6}}}


def without_ids(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: value for key, value in item.items() if key != "id" or item["type"] == "function_call"}
            for item in output]


def test_a_whole_answer_is_a_response() -> None:
    echo = ResponsesRequest.from_body({"input": "x", "max_output_tokens": 4}).echo
    answer = chat_answer({"content": "Hi", "reasoning_content": "Greet.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}]}, "tool_calls")
    out = response(answer, echo, "resp_1")
    assert (out["id"], out["object"], out["status"], out["created_at"], out["model"]) == (
        "resp_1", "response", "completed", 7, "m")
    assert out["max_output_tokens"] == 4 and out["incomplete_details"] is None
    assert without_ids(out["output"]) == [
        {"type": "reasoning", "summary": [], "status": "completed",
         "content": [{"type": "reasoning_text", "text": "Greet."}]},
        {"type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Hi", "annotations": [], "logprobs": []}]},
        {"id": "fc_call_1", "type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a":1}',
         "status": "completed"}]
    assert [item["id"][:3] for item in out["output"]] == ["rs_", "msg", "fc_"]
    assert out["usage"] == {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 6}, "output_tokens": 4,
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14}


def test_a_cut_answer_is_incomplete() -> None:
    out = response(chat_answer({"content": "Hi"}, "length"), {}, "resp_1")
    assert (out["status"], out["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})


# --- the stream ----------------------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], "usage": None}


texts = st.lists(st.text(min_size=1, max_size=5), max_size=4)
streams = st.tuples(texts, texts, st.lists(st.lists(st.sampled_from(['{"a"', ":", "1}"]), max_size=3), max_size=3),
                    st.sampled_from(["stop", "length"]))


@given(streams)
def test_a_stream_s_items_are_the_whole_answer_s(stream: tuple[list[str], list[str], list[list[str]], str]) -> None:
    reasoning, content, calls, finish = stream
    deltas = [{"reasoning_content": t} for t in reasoning] + [{"content": t} for t in content]
    for index, pieces in enumerate(calls):
        deltas.append({"tool_calls": [{"index": index, "id": f"call_{index}", "type": "function",
                                       "function": {"name": f"f{index}", "arguments": ""}}]})
        deltas += [{"tool_calls": [{"index": index, "function": {"arguments": piece}}]} for piece in pieces]
    translator = ResponseStream({}, "resp_1", 7, "m")
    events = translator.start()
    for delta in [{"role": "assistant", "content": None}, *deltas]:
        events += translator.feed(chunk(delta))
    events += translator.feed(chunk({}, finish))
    events += translator.feed({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 4}})
    events += translator.finish()
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert all(name == data["type"] for name, data in events)
    assert [name for name, _ in events[:2]] == ["response.created", "response.in_progress"]
    # each item: added, its deltas, done; one at a time, in output order; the deltas add up to the item
    added = [data["item"]["id"] for name, data in events if name == "response.output_item.added"]
    done = [data["item"] for name, data in events if name == "response.output_item.done"]
    assert added == [item["id"] for item in done]
    for item in done:
        pieces = "".join(data["delta"] for name, data in events if name.endswith(".delta")
                         and data["item_id"] == item["id"])
        whole = item.get("arguments") or "".join(part["text"] for part in item.get("content", []))
        assert pieces == whole
    tool_calls = [{"id": f"call_{i}", "type": "function", "function": {"name": f"f{i}", "arguments": "".join(p)}}
                  for i, p in enumerate(calls)]
    last_name, last = events[-1]
    expected = response(chat_answer({"content": "".join(content), "reasoning_content": "".join(reasoning),
                                     "tool_calls": tool_calls}, finish), {}, "resp_1")
    assert last_name == f"response.{expected['status']}"
    assert last["response"]["output"] == done
    assert without_ids(done) == without_ids(expected["output"])
    assert last["response"]["usage"]["output_tokens"] == 4


def test_a_progress_report_is_an_in_progress_event_and_timings_go_on_a_chunks_last_event() -> None:
    translator = ResponseStream({}, "resp_1", 7, "m")
    translator.start()
    progress = {"total": 40, "cache": 0, "processed": 16, "time_ms": 3.5}
    (report,) = translator.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}],
                                 "prompt_progress": progress})
    assert report[0] == "response.in_progress" and report[1]["prompt_progress"] == progress
    assert report[1]["response"]["status"] == "in_progress" and report[1]["sequence_number"] == 2
    events = translator.feed({"choices": [{"index": 0, "delta": {"content": "hi"}}], "timings": {"prompt_n": 40}})
    assert [name for name, _ in events][-1] == "response.output_text.delta"
    assert events[-1][1]["timings"] == {"prompt_n": 40} and all("timings" not in data for _, data in events[:-1])


def test_a_failure_is_an_error_then_response_failed() -> None:
    events = ResponseStream({}, "resp_1", 7, "m").failed(ApiError(504, "too slow", code="request_timeout"))
    assert [name for name, _ in events] == ["error", "response.failed"]
    assert events[0][1]["message"] == "too slow" and events[1][1]["response"]["status"] == "failed"


# --- the routes, through the openai package over the fake engine ---------------------------------


def test_the_openai_package_reads_whole_and_streamed_responses() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        api = openai_client(client)
        whole = await api.responses.create(model="m", input=[{"role": "system", "content": "Book"},
                                                              {"role": "user", "content": "Best?"}],
                                           max_output_tokens=3, temperature=0.8)
        assert whole.id.startswith("resp_") and whole.output[0].id.startswith("msg_")
        assert whole.output_text == " w0 w1 w2" and whole.status == "incomplete"
        stream = await api.responses.create(model="m", input="x", max_output_tokens=2, stream=True)
        events = [event async for event in stream]
        assert [event.type for event in events] == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
            "response.content_part.done", "response.output_item.done", "response.incomplete"]
        assert events[-1].response.output_text == " w0 w1" and events[-1].response.usage.output_tokens == 2
        counted = await api.responses.input_tokens.count(model="m", input="four")
        assert counted.input_tokens == 5  # BOS and four bytes
        status, _, error = await post(client, "/responses", {"input": "x", "conversation": "c1"})
        assert status == 400 and error["error"]["param"] == "conversation"  # OpenAI's error shape

    run_client(make_backend(engine), scenario)
    assert [ticket.request.max_tokens for ticket in engine.submitted] == [3, 2]


def test_a_failure_mid_stream_is_an_error_then_response_failed_over_http() -> None:
    engine = FakeEngine()
    engine.failure, engine.fail_after = RemoteStageError("stage 1 failed"), 1

    async def scenario(client: TestClient[Any, Any]) -> None:
        response = await client.post("/v1/responses", json={"input": "x", "max_output_tokens": 5, "stream": True})
        names = [block.split("\n")[0].removeprefix("event: ") for block in (await response.text()).split("\n\n")
                 if block]
        assert names == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta", "error", "response.failed"]

    run_client(make_backend(engine), scenario)


# --- through a real serve ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_real_serve_answers_responses_whole_streamed_and_structured(tiny_serve: Any) -> None:  # tests/gateway/conftest.py
    pytest.importorskip("llguidance")
    client = tiny_serve.client(timeout_s=120)
    whole = client.responses.create(model="m", input="Hello", max_output_tokens=6, temperature=0)
    stream = client.responses.create(model="m", input="Hello", max_output_tokens=6, temperature=0, stream=True)
    last = list(stream)[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert last.response.output_text == whole.output_text and whole.usage is not None
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    shaped = client.responses.create(model="m", input="Yes?", max_output_tokens=60, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "ok", "schema": schema}})
    assert shaped.status == "completed" and isinstance(json.loads(shaped.output_text)["ok"], bool)
