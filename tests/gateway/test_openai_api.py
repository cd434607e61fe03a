"""Tests of skippy_zmq.openai_api: request validation, context checks, response shapes, errors."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs

from skippy_zmq.driver.generation import GenerationResult
from skippy_zmq.errors import (
    EngineUnavailable,
    QueueFull,
    RemoteStageError,
    RequestCancelled,
    RequestError,
    RequestJsonError,
    RequestTimeout,
    SkippyError,
    StageRefused,
    StageTimeout,
)
from skippy_zmq.gateway.openai_api import (
    FIELDS,
    IGNORED_FIELDS,
    MAX_TOKENS_BOUND,
    SSE_DONE,
    ApiError,
    Choice,
    ChoiceStreams,
    CompletionParams,
    Endpoint,
    IgnoredFieldLog,
    ResponseShape,
    Usage,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    sse,
    token_piece,
)
from skippy_zmq.gateway.request_json import is_text
from skippy_zmq.tokens.logprobs import TokenLogprobs
from skippy_zmq.tokens.sampling import MAX_LOGIT_BIAS, SamplingParams
from tests.gateway.fakes import TOKENIZER
from tests.strategies import hostile_json

COMPLETIONS = Endpoint.COMPLETIONS
CHAT = Endpoint.CHAT
MESSAGES = [{"role": "user", "content": "hi"}]


def completion(**fields: Any) -> CompletionParams:
    return CompletionParams.from_body(COMPLETIONS, {"prompt": "hello"} | fields)


def chat(**fields: Any) -> CompletionParams:
    return CompletionParams.from_body(CHAT, {"messages": MESSAGES} | fields)


def refused(endpoint: Endpoint, body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        CompletionParams.from_body(endpoint, body)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


# --- defaults and accepted values ----------------------------------------------------------------


def test_completion_defaults_follow_openai() -> None:
    params = completion()
    assert params == CompletionParams(endpoint=COMPLETIONS, prompt="hello")
    assert (params.temperature, params.top_p, params.max_tokens, params.stream) == (1.0, 1.0, None, False)
    sampling = params.sampling(lambda: 7)
    assert sampling == SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=7)


def test_chat_defaults() -> None:
    params = chat()
    assert params.endpoint is CHAT
    assert params.messages == tuple(MESSAGES)
    assert params.prompt == ""


def test_every_supported_field_is_mapped() -> None:
    params = completion(
        model="m", max_tokens=5, temperature=0.5, top_p=0.9, seed=3, stop=["a", "b"], stream=True,
        stream_options={"include_usage": True}, presence_penalty=0, frequency_penalty=0.0, n=1,
        top_k=40, min_p=0.05, repeat_penalty=1.1, ignore_eos=True,
    )
    assert (params.model, params.max_tokens, params.stop, params.stream, params.include_usage) == (
        "m", 5, ("a", "b"), True, True
    )
    assert params.sampling() == SamplingParams(
        temperature=0.5, top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.1, seed=3, ignore_eos=True
    )


@pytest.mark.parametrize(("name", "value"), [
    ("logprobs", False), ("echo", False), ("logit_bias", {}), ("user", "alice"), ("suffix", ""),
    ("best_of", 1), ("n", 1), ("metadata", {"k": "v"}), ("store", False), ("service_tier", "auto"),
    ("presence_penalty", 0), ("frequency_penalty", 0.0), ("store", True), ("service_tier", "flex"),
    ("cache_prompt", True), ("timings_per_token", False), ("safety_identifier", "u1"), ("prompt_cache_key", "k"),
])
def test_neutral_completion_fields_are_accepted(name: str, value: Any) -> None:
    assert completion(**{name: value}) == completion()


@pytest.mark.parametrize(("name", "value"), [
    ("response_format", {"type": "text"}), ("tools", []), ("functions", []), ("tool_choice", "none"),
    ("tool_choice", "auto"), ("function_call", "none"), ("parallel_tool_calls", True),
    ("modalities", ["text"]), ("logprobs", False), ("prediction", {"type": "content", "content": "x"}),
])
def test_neutral_chat_fields_are_accepted(name: str, value: Any) -> None:
    assert chat(**{name: value}) == chat()


def test_speculative_n_max_sets_the_request_s_draft_budget_on_both_routes() -> None:
    assert completion(**{"speculative.n_max": 5}).draft_max == 5
    assert chat(**{"speculative.n_max": 0}).draft_max == 0  # 0: no drafts, whatever serve's --draft-max
    assert completion().draft_max is None
    assert completion(**{"speculative.n_min": 2, "speculative.p_min": 0.75}) == completion()  # a draft model's


@pytest.mark.parametrize("value", [33, -1, 2.5, True, "4"])
def test_a_draft_budget_outside_0_to_32_is_a_400_naming_it(value: Any) -> None:
    assert refused(CHAT, {"messages": MESSAGES, "speculative.n_max": value}).param == "speculative.n_max"


def test_null_is_the_same_as_absent() -> None:
    nulls = {name: None for name in FIELDS if name not in ("prompt", "messages", "stream_options")}
    nulls.pop("messages", None)
    assert completion(**{k: v for k, v in nulls.items() if COMPLETIONS in FIELDS[k][0]}) == completion()
    assert chat(**{k: v for k, v in nulls.items() if CHAT in FIELDS[k][0]}) == chat()


@pytest.mark.parametrize(("prompt", "expected"), [
    ("text", "text"),
    ("", ""),
    ([1, 2, 3], (1, 2, 3)),
    (["only one"], "only one"),
    ([[4, 5]], (4, 5)),
])
def test_prompt_forms(prompt: Any, expected: Any) -> None:
    assert completion(prompt=prompt).prompt == expected


def test_stop_forms() -> None:
    assert completion(stop="x").stop == ("x",)
    assert completion(stop=["x", "", "y"]).stop == ("x", "y")
    assert completion(stop="").stop == ()
    assert completion(stop=["1", "2", "3", "4"]).stop == ("1", "2", "3", "4")


def test_max_completion_tokens() -> None:
    params = chat(max_completion_tokens=9)
    assert (params.max_tokens, params.max_tokens_field) == (9, "max_completion_tokens")
    assert chat(max_tokens=9, max_completion_tokens=9).max_tokens == 9
    assert completion(max_completion_tokens=3).max_tokens == 3


def test_greedy_and_seed_mapping() -> None:
    assert completion(temperature=0).sampling(lambda: 1).is_greedy
    top_p_zero = completion(temperature=0.7, top_p=0).sampling(lambda: 1)
    assert top_p_zero.is_greedy and top_p_zero.top_p == 1.0
    assert completion(seed=-1).sampling().seed == 2**64 - 1
    assert completion(seed=2**64 - 1).sampling().seed == 2**64 - 1
    assert completion(top_k=-1).top_k == 0
    seeds = {completion().sampling().seed for _ in range(4)}
    assert len(seeds) > 1  # without a seed every request draws a fresh one


def test_include_usage_false_and_obfuscation_accepted() -> None:
    params = completion(stream=True, stream_options={"include_usage": False, "include_obfuscation": True})
    assert params.stream and not params.include_usage


# --- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "value"), [
    ("n", 0), ("n", True), ("n", 1.0), ("best_of", 2), ("echo", True), ("logprobs", True), ("logprobs", 6),
    ("logprobs", -1), ("logprobs", 1.0), ("suffix", "end"), ("presence_penalty", 2.5), ("frequency_penalty", -2.01),
    ("presence_penalty", "0"), ("frequency_penalty", float("nan")), ("store", "yes"), ("service_tier", 1),
    ("metadata", "x"), ("cache_prompt", 1), ("timings_per_token", "no"), ("safety_identifier", 5),
    ("logit_bias", []), ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", {"1.0": 1}),
    ("logit_bias", {" 1": 1}), ("logit_bias", {"\u0663": 1}), ("logit_bias", {"1": 100.5}),
    ("logit_bias", {"1": -101}), ("logit_bias", {"1": "5"}), ("logit_bias", {"1": True}),
    ("logit_bias", {"1": 1, "01": 2}), ("logit_bias", {"2147483648": 1}),
    ("temperature", 2.5), ("temperature", -0.1), ("temperature", "1"), ("temperature", True),
    ("temperature", float("nan")), ("top_p", 1.5), ("top_p", -0.1), ("top_k", -2), ("top_k", 1.5),
    ("min_p", 1.1), ("repeat_penalty", 0), ("repeat_penalty", float("inf")), ("ignore_eos", 1),
    # beyond what the stage link carries (int32 top_k, float32 repeat_penalty)
    ("top_k", 2**31), ("repeat_penalty", 1e300), ("repeat_penalty", 1e-50),
    ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 1.0), ("max_tokens", "5"),
    ("max_tokens", MAX_TOKENS_BOUND + 1), ("max_completion_tokens", 10**30),
    ("max_completion_tokens", -1), ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.5),
    ("stream", "yes"), ("user", 5), ("model", 1), ("stop", 5), ("stop", ["a", 1]),
    ("stop", ["1", "2", "3", "4", "5"]),
])
def test_bad_completion_field_is_a_400_naming_it(name: str, value: Any) -> None:
    error = refused(COMPLETIONS, {"prompt": "p", name: value})
    assert error.param == name
    assert error.body()["error"]["param"] == name


@pytest.mark.parametrize(("name", "value"), [
    ("response_format", "json"), ("tools", [{"type": "function"}]), ("tool_choice", "required"),
    ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}), ("top_logprobs", 2), ("top_logprobs", 0),
    ("parallel_tool_calls", "yes"), ("modalities", ["text", "audio"]), ("logprobs", 2), ("prediction", "x"),
    ("reasoning_effort", 1), ("reasoning_effort", ""), ("reasoning_format", "think"), ("chat_template_kwargs", []),
    ("chat_template_kwargs", {"enable_thinking": "true"}),
])
def test_bad_chat_field_is_a_400_naming_it(name: str, value: Any) -> None:
    param = refused(CHAT, {"messages": MESSAGES, name: value}).param
    assert param is not None and re.match(rf"{name}(\[\d+\].*)?$", param), param


@pytest.mark.parametrize(("endpoint", "name"), [
    (COMPLETIONS, "messages"), (COMPLETIONS, "tools"),
    (CHAT, "prompt"), (CHAT, "echo"), (CHAT, "suffix"), (CHAT, "best_of"), (COMPLETIONS, "top_logprobs"),
    (COMPLETIONS, "prediction"), (COMPLETIONS, "parallel_tool_calls"), (COMPLETIONS, "reasoning_effort"),
    (COMPLETIONS, "frobnicate"), (CHAT, "audio"),
])
def test_unknown_field_is_a_400_naming_it(endpoint: Endpoint, name: str) -> None:
    body = {"prompt": "p"} if endpoint is COMPLETIONS else {"messages": MESSAGES}
    error = refused(endpoint, body | {name: 1})
    assert error.param == name
    assert "unknown field" in error.message


@pytest.mark.parametrize("body", [[], "x", 3, None])
def test_body_must_be_an_object(body: Any) -> None:
    assert refused(COMPLETIONS, body).param is None


def test_required_fields() -> None:
    assert refused(COMPLETIONS, {}).param == "prompt"
    assert refused(COMPLETIONS, {"prompt": None}).param == "prompt"
    assert refused(CHAT, {}).param == "messages"


@pytest.mark.parametrize("prompt", [
    [], ["a", "b"], [[1], [2]], [1, "a"], [-1], [True, 2], [2**31], 5, {"text": "x"}, [[]], [1.0],
])
def test_bad_prompt_is_a_400(prompt: Any) -> None:
    assert refused(COMPLETIONS, {"prompt": prompt}).param == "prompt"


def test_several_prompts_are_refused_with_a_reason() -> None:
    assert "one request per prompt" in refused(COMPLETIONS, {"prompt": ["a", "b"]}).message


def test_a_batch_of_prompts_is_one_request_each_on_the_batch_reader_only() -> None:
    batch = CompletionParams.batch_from_body(COMPLETIONS, {"prompt": ["a", [5, 6]], "max_tokens": 3})
    assert [(params.prompt, params.max_tokens) for params in batch] == [("a", 3), ((5, 6), 3)]
    assert [p.prompt for p in CompletionParams.batch_from_body(COMPLETIONS, {"prompt": [5, 6]})] == [(5, 6)]
    assert len(CompletionParams.batch_from_body(CHAT, {"messages": MESSAGES})) == 1
    for body, param in (({"prompt": ["a", [-1]]}, "prompt[1]"), ({"prompt": ["a", "b"], "n": 2}, "n"),
                        ({"prompt": ["a"] * 65}, "prompt")):
        with pytest.raises(ApiError) as info:
            CompletionParams.batch_from_body(COMPLETIONS, body)
        assert info.value.param == param, info.value.message


def test_n_predict_stands_for_max_tokens_when_neither_is_given() -> None:
    assert (completion(n_predict=5).max_tokens, completion(n_predict=5).max_tokens_field) == (5, "n_predict")
    assert completion(n_predict=-1).max_tokens is None and completion(n_predict=9, max_tokens=2).max_tokens == 2
    assert refused(COMPLETIONS, {"prompt": "x", "n_predict": 0}).param == "n_predict"


def test_a_last_assistant_message_is_continued_unless_the_body_says_otherwise() -> None:
    prefill = [*MESSAGES, {"role": "assistant", "content": "Wh"}]
    assert (chat().add_generation_prompt, chat().continue_final) == (True, False)
    continued = chat(messages=prefill)
    assert (continued.add_generation_prompt, continued.continue_final) == (False, True)
    explicit = chat(messages=prefill, continue_final_message="content", add_generation_prompt=False)
    assert explicit.continue_final and not chat(messages=prefill, continue_final_message=False).continue_final
    assert not chat(add_generation_prompt=False).add_generation_prompt
    for body in ({"messages": prefill, "continue_final_message": True}, {"messages": MESSAGES,
                 "continue_final_message": True, "add_generation_prompt": False}):
        assert refused(CHAT, body).param == "continue_final_message"


@pytest.mark.parametrize(("messages", "param"), [
    ([], "messages"), ("hi", "messages"), ({"role": "user"}, "messages"), ([MESSAGES[0], "x"], "messages[1]"),
])
def test_bad_messages_are_a_400(messages: Any, param: str) -> None:
    assert refused(CHAT, {"messages": messages}).param == param


# --- the body as received: huge integers, invalid text -------------------------------------------

HUGE = b"9" * 5000


def refused_json(endpoint: Endpoint, data: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        CompletionParams.from_json(endpoint, data)
    assert (info.value.status, info.value.type) == (400, "invalid_request_error")
    return info.value


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens", "seed", "top_k", "temperature", "top_p",
                                  "min_p", "repeat_penalty", "n", "presence_penalty", "stream", "user", "model"])
def test_an_integer_of_5000_digits_is_refused_by_the_fields_bounds(name: str) -> None:
    error = refused_json(COMPLETIONS, b'{"prompt": "p", "%s": %s}' % (name.encode(), HUGE))
    assert error.param == name
    assert "an integer of 5000 digits" in error.message and len(error.message) < 300


def test_huge_integers_elsewhere_are_refused_naming_the_field() -> None:
    assert refused_json(COMPLETIONS, b'{"prompt": [1, %s]}' % HUGE).message == (
        "prompt holds token id an integer of 5000 digits; token ids are integers in [0, 2147483647]")
    assert refused_json(COMPLETIONS, b'{"prompt": "p", "bogus": -%s}' % HUGE).param == "bogus"
    assert refused_json(COMPLETIONS, b'{"prompt": "p", "logit_bias": {"5": %s}}' % HUGE).param == "logit_bias"
    # OpenAI's free-form metadata is accepted as given, and ignored
    assert CompletionParams.from_json(COMPLETIONS, b'{"prompt": "p", "metadata": {"k": %s}}' % HUGE).prompt == "p"


@pytest.mark.parametrize(("endpoint", "data", "param"), [
    (COMPLETIONS, b'{"prompt": "a\\ud800b"}', "prompt"),
    (COMPLETIONS, b'{"prompt": ["a\\ud800b"]}', "prompt[0]"),
    (COMPLETIONS, b'{"prompt": "p", "stop": ["x", "\\udfff"]}', "stop[1]"),
    (COMPLETIONS, b'{"prompt": "p", "model": "\\ud800"}', "model"),
    (COMPLETIONS, b'{"prompt": "p", "user": "\\ud800"}', "user"),
    (COMPLETIONS, b'{"prompt": "p", "a\\ud800b": 1}', "a\\ud800b"),
    (CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
    (CHAT, b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages[0].content[0].text"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x", "\\ud800": null}]}', "messages[0].\\ud800"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stream": true, "stream_options": {"\\ud800": 1}}',
     "stream_options.\\ud800"),
])
def test_a_lone_surrogate_anywhere_is_refused_as_invalid_text(endpoint: Endpoint, data: bytes, param: str) -> None:
    error = refused_json(endpoint, data)
    assert error.param == param
    assert "is not valid Unicode text: it holds a lone surrogate" in error.message
    json.dumps(error.body(), ensure_ascii=False).encode("utf-8")  # the answer itself is valid text


def test_a_surrogate_pair_is_text() -> None:
    assert CompletionParams.from_json(COMPLETIONS, b'{"prompt": "\\ud83d\\ude00"}').prompt == "\U0001f600"


def test_a_body_that_is_not_utf8_json() -> None:
    assert "byte 0 (b'\\xff') is not UTF-8" in refused_json(COMPLETIONS, b"\xff{}").message
    assert "nests JSON too deeply" in refused_json(COMPLETIONS, b"[" * 100_000).message


def test_an_answer_holding_a_lone_surrogate_still_encodes() -> None:
    event = sse({"text": "a\ud800"})  # as a JSON escape: the stream goes on instead of failing to encode
    assert json.loads(event.decode("utf-8").removeprefix("data: "))["text"] == "a\ud800"


def test_request_json_errors_map_to_400_with_their_param() -> None:
    error = ApiError.from_exception(RequestJsonError("prompt is not valid Unicode text", param="prompt"))
    assert (error.status, error.param, error.code) == (400, "prompt", None)


def test_values_in_messages_are_cut_short() -> None:
    error = refused(COMPLETIONS, {"prompt": "p", "temperature": "x" * 100_000})
    assert len(error.message) < 200 and error.message.endswith("...")
    assert len(refused(COMPLETIONS, {"prompt": "p", "model": 5}).message) < 200


_KEYS = [*FIELDS, "content", "role", "type", "text", "include_usage"]


@given(hostile_json(_KEYS, {"prompt": st.just("p")}) | hostile_json(_KEYS, {"messages": st.just(MESSAGES)})
       | hostile_json(_KEYS))
@settings(max_examples=400, deadline=None)
def test_any_hostile_body_gives_params_or_a_4xx_with_valid_text(data: bytes) -> None:
    for endpoint in Endpoint:
        try:
            params = CompletionParams.from_json(endpoint, data)
        except ApiError as error:
            assert 400 <= error.status < 500
            json.dumps(error.body(), ensure_ascii=False).encode("utf-8")
            continue
        assert isinstance(params.prompt, tuple) or is_text(params.prompt)
        assert all(is_text(stop) for stop in params.stop)
        params.sampling()  # every accepted value fits the sampler (and the stage link)


def test_stream_options_rules() -> None:
    assert refused(COMPLETIONS, {"prompt": "p", "stream_options": {"include_usage": True}}).param == "stream_options"
    body = {"prompt": "p", "stream": True}
    assert refused(COMPLETIONS, body | {"stream_options": {"x": 1}}).param == "stream_options.x"
    assert refused(COMPLETIONS, body | {"stream_options": []}).param == "stream_options"
    assert refused(COMPLETIONS, body | {"stream_options": {"include_usage": 1}}).param == "stream_options.include_usage"


def test_max_tokens_fields_must_agree() -> None:
    error = refused(CHAT, {"messages": MESSAGES, "max_tokens": 3, "max_completion_tokens": 4})
    assert error.param == "max_completion_tokens"


@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
))
@settings(max_examples=200, deadline=None)
def test_any_json_gives_params_or_an_api_error(value: Any) -> None:
    for endpoint in Endpoint:
        for body in (value, {"prompt": value}, {"messages": value}, {"prompt": "p", "stop": value}):
            try:
                CompletionParams.from_body(endpoint, body)
            except ApiError as error:
                assert error.status == 400
                json.dumps(error.body())


_VALID_VALUES: dict[str, Any] = {
    "max_tokens": st.integers(1, 10**6), "temperature": st.floats(0, 2), "top_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**64 - 1), "stop": st.lists(st.text(max_size=4), max_size=4),
    "top_k": st.integers(-1, 1000), "min_p": st.floats(0, 1), "repeat_penalty": st.floats(0.01, 10),
    "ignore_eos": st.booleans(), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "n": st.integers(1, 16), "user": st.text(max_size=5), "logprobs": st.integers(0, 5),
    "logit_bias": st.dictionaries(st.integers(0, 2**31 - 1).map(str), st.floats(-100, 100), max_size=8),
}


@given(st.fixed_dictionaries({}, optional=_VALID_VALUES))
@settings(max_examples=200, deadline=None)
def test_valid_values_always_parse_into_valid_sampling(fields: dict[str, Any]) -> None:
    params = CompletionParams.from_body(COMPLETIONS, {"prompt": "p"} | fields)
    params.sampling()  # SamplingParams' own validators accept every mapped value


# --- model and context ---------------------------------------------------------------------------


def test_generation_request_defaults() -> None:
    request = completion(seed=5, stop="x").generation_request([1, 2, 3], 100, n_vocab=10, prompt_text="abc")
    assert (request.prompt, request.prompt_ids, request.max_tokens, request.stop) == ("abc", (1, 2, 3), 16, ("x",))
    assert request.sampling.seed == 5
    assert chat().generation_request([1, 2, 3], 100, n_vocab=10).max_tokens == 97  # chat: up to the context
    assert completion().generation_request([1] * 90, 100, n_vocab=10).max_tokens == 10  # default clamped
    assert completion(max_tokens=97).generation_request([1, 2, 3], 100, n_vocab=10).max_tokens == 97


@pytest.mark.parametrize(("endpoint", "fields", "count", "param"), [
    (COMPLETIONS, {}, 100, "prompt"),
    (COMPLETIONS, {}, 150, "prompt"),
    (CHAT, {}, 100, "messages"),
    (COMPLETIONS, {"max_tokens": 98}, 3, "max_tokens"),
    (CHAT, {"max_completion_tokens": 98}, 3, "max_completion_tokens"),
])
def test_context_length_exceeded(endpoint: Endpoint, fields: dict[str, Any], count: int, param: str) -> None:
    body = ({"prompt": "p"} if endpoint is COMPLETIONS else {"messages": MESSAGES}) | fields
    params = CompletionParams.from_body(endpoint, body)
    with pytest.raises(ApiError) as info:
        params.generation_request([1] * count, 100, n_vocab=10)
    assert (info.value.status, info.value.code, info.value.param) == (400, "context_length_exceeded", param)
    assert "100" in info.value.message


def test_prompt_ids_checked_against_the_vocab() -> None:
    with pytest.raises(ApiError) as info:
        completion(prompt=[1, 10]).generation_request([1, 10], 100, n_vocab=10)
    assert (info.value.status, info.value.param, info.value.code) == (400, "prompt", None)
    with pytest.raises(ApiError):
        completion().generation_request([], 100, n_vocab=10)


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("error", "status", "code", "retry"), [
    (QueueFull("full"), 429, "queue_full", 1),
    (EngineUnavailable("starting"), 503, "pipeline_unavailable", 5),
    (StageTimeout("silent"), 503, "pipeline_unavailable", 5),
    (StageRefused("refused"), 503, "pipeline_unavailable", 5),
    (RequestTimeout("late"), 504, "request_timeout", None),
    (RequestCancelled("gone"), 499, "request_cancelled", None),
    (RequestError("bad"), 400, None, None),
    (RemoteStageError("boom"), 500, "internal_error", None),
    (SkippyError("other"), 500, "internal_error", None),
])
def test_engine_errors_map_by_class(error: SkippyError, status: int, code: str | None, retry: int | None) -> None:
    api = ApiError.from_exception(error)
    assert (api.status, api.code, api.retry_after_s, api.message) == (status, code, retry, str(error))
    assert set(api.body()["error"]) == {"message", "type", "param", "code"}


def test_api_error_passes_through_and_unavailable() -> None:
    original = ApiError.invalid("x", "bad x")
    assert ApiError.from_exception(original) is original
    unavailable = ApiError.unavailable("starting: loading stages")
    assert (unavailable.status, unavailable.retry_after_s) == (503, 5)
    assert unavailable.body() == {"error": {
        "message": "starting: loading stages", "type": "service_unavailable_error", "param": None,
        "code": "pipeline_unavailable",
    }}


def test_unauthorized_and_client_cap_errors() -> None:
    wrong = ApiError.unauthorized(key_given=True)
    assert (wrong.status, wrong.retry_after_s) == (401, None)
    assert wrong.body() == {"error": {"message": "Incorrect API key provided.", "type": "authentication_error",
                                      "param": None, "code": "invalid_api_key"}}
    missing = ApiError.unauthorized(key_given=False)
    assert (missing.status, missing.type, missing.code) == (401, "authentication_error", None)
    assert "Authorization: Bearer" in missing.message
    overflow = ApiError.context_length("prompt", "too long", n_prompt_tokens=70, n_ctx=64)
    assert overflow.body() == {"error": {"message": "too long", "type": "exceed_context_size_error", "param": "prompt",
                                         "code": "context_length_exceeded", "n_prompt_tokens": 70, "n_ctx": 64}}
    capped = ApiError.client_cap(64)
    assert (capped.status, capped.type, capped.code, capped.retry_after_s) == (429, "rate_limit_error",
                                                                               "too_many_requests", 1)
    assert "cap of 64 requests in flight" in capped.message


# --- responses -----------------------------------------------------------------------------------


def shape(endpoint: Endpoint, include_usage: bool = False) -> ResponseShape:
    return ResponseShape(endpoint, endpoint.id_prefix + "abc", 1700000000, "tiny", include_usage)


def test_finish_reason_mapping() -> None:
    assert [finish_reason(r) for r in ("eos", "stop", "length")] == ["stop", "stop", "length"]


def test_usage_of_a_result() -> None:
    result = GenerationResult(prompt="p", prompt_ids=[1, 2, 3], tokens=[4, 5])
    assert Usage.of(result).as_dict() == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_completion_response_shape() -> None:
    body = shape(COMPLETIONS).response([Choice(0, "Paris", "eos")], Usage(3, 2))
    assert body == {
        "id": "cmpl-abc", "object": "text_completion", "created": 1700000000, "model": "tiny",
        "choices": [{"index": 0, "text": "Paris", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    assert Completion.model_validate(body).choices[0].text == "Paris"


def test_chat_response_shape() -> None:
    body = shape(CHAT).response([Choice(0, "Hi", "length")], Usage(4, 1))
    parsed = ChatCompletion.model_validate(body)
    assert parsed.object == "chat.completion"
    assert parsed.choices[0].message.content == "Hi"
    assert parsed.choices[0].finish_reason == "length"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}


def test_chat_stream_chunks() -> None:
    built = shape(CHAT, include_usage=True)
    first = built.first_chunk()
    assert first is not None
    chunks = [first, built.text_chunk("a"), built.final_chunk("stop"), built.usage_chunk(Usage(1, 1))]
    parsed = [ChatCompletionChunk.model_validate(chunk) for chunk in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}  # llama-server's null, not ""
    assert parsed[1].choices[0].delta.content == "a"
    assert parsed[2].choices[0].finish_reason == "stop"
    assert chunks[2]["choices"][0]["delta"] == {}
    assert chunks[1]["usage"] is None
    assert parsed[3].choices == [] and parsed[3].usage is not None and parsed[3].usage.total_tokens == 2
    assert {chunk["id"] for chunk in chunks} == {"chatcmpl-abc"}


def test_completion_stream_chunks() -> None:
    built = shape(COMPLETIONS)
    assert built.first_chunk() is None
    chunk = built.text_chunk("x")
    assert chunk == {"id": "cmpl-abc", "object": "text_completion", "created": 1700000000, "model": "tiny",
                     "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}]}
    final = built.final_chunk("length")
    assert final["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    Completion.model_validate(built.usage_chunk(Usage(2, 3)))


def test_new_shape_ids_are_fresh() -> None:
    a = ResponseShape.new(CHAT, "m")
    b = ResponseShape.new(CHAT, "m")
    assert a.id.startswith("chatcmpl-") and a.id != b.id
    assert ResponseShape.new(COMPLETIONS, "m").id.startswith("cmpl-")


def test_sse_framing() -> None:
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


# --- issue 18: logprobs, n, penalties, logit_bias, ignored fields --------------------------------


def test_completion_logprobs_is_the_alternatives_per_token() -> None:
    assert completion().logprobs is None
    assert completion(logprobs=False).logprobs is None
    assert completion(logprobs=0).logprobs == 0
    assert completion(logprobs=5).logprobs == 5
    assert "integer in [0, 5]" in refused(COMPLETIONS, {"prompt": "p", "logprobs": 6}).message


def test_chat_logprobs_and_top_logprobs() -> None:
    assert chat().logprobs is None
    assert chat(logprobs=False).logprobs is None
    assert chat(logprobs=True).logprobs == 0
    assert chat(logprobs=True, top_logprobs=20).logprobs == 20
    assert refused(CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}).param == "top_logprobs"
    error = refused(CHAT, {"messages": MESSAGES, "logprobs": False, "top_logprobs": 3})
    assert (error.param, error.message) == ("top_logprobs", "top_logprobs 3 needs logprobs: true")


def test_n_and_best_of() -> None:
    assert completion(n=3).n == 3
    assert completion(n=3, best_of=3).n == 3
    error = refused(COMPLETIONS, {"prompt": "p", "n": 2, "best_of": 3})
    assert error.param == "best_of" and "equal to n" in error.message


def test_penalties_reach_the_sampler() -> None:
    params = chat(presence_penalty=-2, frequency_penalty=1.5)
    sampling = params.sampling(lambda: 1)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (-2.0, 1.5)
    assert "[-2, 2]" in refused(CHAT, {"messages": MESSAGES, "presence_penalty": 3}).message


def test_logit_bias_parses_to_sorted_pairs() -> None:
    params = completion(logit_bias={"50256": -100, "7": 2.5, "0": 100})
    assert params.logit_bias == ((0, 100.0), (7, 2.5), (50256, -100.0))
    assert params.sampling(lambda: 1).logit_bias == params.logit_bias
    assert completion(logit_bias={}).logit_bias == ()


@pytest.mark.parametrize(("bias", "says"), [
    ({"abc": 1}, "key 'abc' is not a token id"),
    ({"1": 200}, "logit_bias['1'] must be a number in [-100, 100], got 200"),
    ({"5": 1, "005": 1}, "names token 5 a second time"),
    ([[1, 5]], "must be an object mapping token ids"),
])
def test_a_bad_logit_bias_names_the_key(bias: Any, says: str) -> None:
    error = refused(CHAT, {"messages": MESSAGES, "logit_bias": bias})
    assert error.param == "logit_bias"
    assert says in error.message


def test_logit_bias_size_is_bounded() -> None:
    bias = {str(token): 1 for token in range(MAX_LOGIT_BIAS + 1)}
    assert f"at most {MAX_LOGIT_BIAS}" in refused(COMPLETIONS, {"prompt": "p", "logit_bias": bias}).message
    assert len(completion(logit_bias=dict(list(bias.items())[:MAX_LOGIT_BIAS])).logit_bias) == MAX_LOGIT_BIAS


@given(st.dictionaries(st.text(max_size=12) | st.integers(-5, 2**32).map(str),
                       st.integers(-150, 150) | st.floats(allow_nan=True) | st.booleans() | st.text(max_size=2),
                       max_size=6))
@settings(max_examples=300, deadline=None)
def test_any_logit_bias_object_gives_valid_pairs_or_a_400_naming_it(bias: dict[str, Any]) -> None:
    try:
        params = completion(logit_bias=bias)
    except ApiError as error:
        assert (error.status, error.param) == (400, "logit_bias")
        return
    assert params.sampling(lambda: 1).logit_bias == params.logit_bias  # SamplingParams' validator agrees
    assert [token for token, _ in params.logit_bias] == sorted(int(key) for key in bias)


def test_generation_request_carries_the_new_fields() -> None:
    params = completion(logprobs=3, n=2, seed=9, logit_bias={"4": -100}, presence_penalty=0.5)
    request = params.generation_request([1, 2], 100, n_vocab=10)
    assert (request.logprobs, request.n, request.sampling.seed) == (3, 2, 9)  # the scheduler adds the choice
    assert request.sampling.logit_bias == ((4, -100.0),)
    assert request.sampling.presence_penalty == 0.5


def test_a_logit_bias_id_outside_the_vocab_is_a_400() -> None:
    with pytest.raises(ApiError) as info:
        completion(logit_bias={"3": 1, "10": 1}).generation_request([1], 100, n_vocab=10)
    assert (info.value.status, info.value.param) == (400, "logit_bias")
    assert '"10"' in info.value.message and "0..9" in info.value.message


def test_ignored_fields_are_logged_once_per_name(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    from skippy_zmq.gateway import openai_api

    monkeypatch.setattr(openai_api, "IGNORED_LOG", IgnoredFieldLog())
    monkeypatch.setattr(logging.getLogger("skippy_zmq"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="skippy_zmq.gateway")
    for _ in range(3):
        assert chat(user="u", id_slot=2, metadata={"a": 1}) == chat()
    lines = [r for r in caplog.records if r.name == "skippy_zmq.gateway" and "accepts and ignores" in r.message]
    assert sorted(r.args[0] for r in lines) == ["id_slot", "metadata", "user"]  # type: ignore[index]
    # timings_per_token and return_progress act (on streams), so they are not among the ignored
    assert chat(timings_per_token=True, return_progress=True).timings_per_token
    assert len([r for r in caplog.records if "accepts and ignores" in r.message]) == 3
    assert {r.levelno for r in lines} == {logging.WARNING}


def test_cache_prompt_false_reaches_the_engine_request_and_the_default_is_on() -> None:
    assert completion().generation_request([1, 2], 64, n_vocab=10).cache_prompt is True
    assert completion(cache_prompt=False).generation_request([1, 2], 64, n_vocab=10).cache_prompt is False
    assert chat(cache_prompt=False).generation_request([1, 2], 64, n_vocab=10).cache_prompt is False


def test_every_ignored_field_has_a_row() -> None:
    assert set(FIELDS) >= IGNORED_FIELDS
    assert not IGNORED_FIELDS & {"tools", "response_format", "echo", "suffix", "logit_bias", "n"}


# --- logprobs and choices in responses -----------------------------------------------------------

PIECES = {5: b" Par", 6: b"is", 7: b"\xe2", 1: b"<eos>", 8: b" Lyon"}
ENTRIES = (TokenLogprobs(5, -0.25, ((5, -0.25), (8, -1.5))), TokenLogprobs(6, -0.5, ((8, -0.1),)),
           TokenLogprobs(1, -2.0))


def piece(token: int) -> bytes:
    return PIECES[token]


def logprob_shape(endpoint: Endpoint, include_usage: bool = False) -> ResponseShape:
    return ResponseShape(endpoint, endpoint.id_prefix + "abc", 1700000000, "tiny", include_usage, piece)


def test_completion_logprobs_shape() -> None:
    built = completion_logprobs(ENTRIES, piece, offset=3)
    assert built == {
        "tokens": [" Par", "is", "<eos>"],
        "token_logprobs": [-0.25, -0.5, -2.0],
        # the sampled token is always there, so up to k + 1 entries (OpenAI's rule)
        "top_logprobs": [{" Par": -0.25, " Lyon": -1.5}, {" Lyon": -0.1, "is": -0.5}, {"<eos>": -2.0}],
        "text_offset": [3, 7, 9],
    }


def test_chat_logprobs_shape_and_bytes() -> None:
    built = chat_logprobs((TokenLogprobs(7, -1.0, ((7, -1.0),)),), piece)
    assert built["content"] == [{"token": "\ufffd", "logprob": -1.0, "bytes": [0xE2],
                                 "top_logprobs": [{"token": "\ufffd", "logprob": -1.0, "bytes": [0xE2]}]}]


def test_whole_responses_with_logprobs_and_choices_validate_as_openai() -> None:
    choices = [Choice(1, "Lyon", "length", ENTRIES[:1]), Choice(0, "Paris", "eos", ENTRIES)]
    body = logprob_shape(CHAT).response(choices, Usage(3, 4))
    parsed = ChatCompletion.model_validate(body)
    assert [c.index for c in parsed.choices] == [0, 1]
    assert [c.finish_reason for c in parsed.choices] == ["stop", "length"]
    first = parsed.choices[0].logprobs
    assert first is not None and first.content is not None
    assert [(t.token, t.logprob) for t in first.content] == [(" Par", -0.25), ("is", -0.5), ("<eos>", -2.0)]
    assert [t.token for t in first.content[0].top_logprobs] == [" Par", " Lyon"]
    text = logprob_shape(COMPLETIONS).response(choices, Usage(3, 4))
    parsed_text = Completion.model_validate(text)
    assert parsed_text.choices[1].logprobs is not None
    assert parsed_text.choices[1].logprobs.tokens == [" Par"]
    assert logprob_shape(CHAT).response([Choice(0, "x", "eos")], Usage(1, 1))["choices"][0]["logprobs"] is None


def test_usage_of_all_choices() -> None:
    results = [GenerationResult(prompt="p", prompt_ids=[1, 2, 3], tokens=[4, 5], choice=0),
               GenerationResult(prompt="p", prompt_ids=[1, 2, 3], tokens=[6], choice=1)]
    assert Usage.of_all(results).as_dict() == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_choice_streams_carry_logprobs_with_their_text() -> None:
    streams = ChoiceStreams(logprob_shape(COMPLETIONS, include_usage=True), 2, logprobs=True)
    assert streams.opening() == []
    (first,) = streams.delta(0, " Par", ENTRIES[:1])
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    assert streams.delta(1, "", ENTRIES[:1]) == []  # held back: its logprobs wait
    (second,) = streams.delta(0, "is", ENTRIES[1:2])
    assert second["choices"][0]["logprobs"]["text_offset"] == [4]
    (held,) = streams.delta(1, " Lyon", ())
    assert held["choices"][0]["index"] == 1
    assert held["choices"][0]["logprobs"]["tokens"] == [" Par"]
    streams.delta(0, "", ENTRIES[2:])  # EOS: no text, a logprob all the same
    results = [GenerationResult(prompt="p", prompt_ids=[1], tokens=[5, 6, 1], finish_reason="eos", choice=0),
               GenerationResult(prompt="p", prompt_ids=[1], tokens=[5], finish_reason="length", choice=1)]
    ending = streams.ending(results[::-1])
    assert [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in ending[:2]] == [
        (0, "stop"), (1, "length")]
    assert ending[0]["choices"][0]["logprobs"]["tokens"] == ["<eos>"]
    assert ending[0]["choices"][0]["logprobs"]["text_offset"] == [6]
    assert ending[1]["choices"][0]["logprobs"]["tokens"] == []
    assert ending[2]["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
    for chunk in ending:  # text chunks have finish_reason null, which Completion's model does not allow
        Completion.model_validate(chunk)
    for chunk in [first, second, held]:
        Logprobs.model_validate(chunk["choices"][0]["logprobs"])


def test_chat_streams_open_every_choice_and_omit_logprobs_unless_asked() -> None:
    streams = ChoiceStreams(logprob_shape(CHAT), 3, logprobs=False)
    assert [c["choices"][0]["index"] for c in streams.opening()] == [0, 1, 2]
    (chunk,) = streams.delta(2, "x", ENTRIES[:1])
    assert chunk["choices"][0]["logprobs"] is None
    ChatCompletionChunk.model_validate(chunk)
    with pytest.raises(ApiError) as info:
        streams.delta(3, "y", ())
    assert info.value.status == 500 and "choices 0..2" in info.value.message


def test_token_piece_names_control_tokens() -> None:
    render = token_piece(TOKENIZER)
    assert render(4 + ord("a")) == b"a"
    assert render(1) == b"<eos>"


def test_usage_names_the_cached_prompt_tokens_only_when_there_are_some() -> None:
    assert "prompt_tokens_details" not in Usage(3, 2).as_dict()
    assert Usage(5, 2, cached_tokens=4).as_dict() == {
        "prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 4}}


# --- constraints --------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("fields", "kind", "text"), [
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "json_schema", json.dumps(SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}},
     "json_schema", json.dumps(SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}}, "json_schema", "{}"),
    ({"json_schema": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
    ({"grammar": 'root ::= "a"'}, "gbnf", 'root ::= "a"'),
    ({"grammar": '%llguidance {}\nstart: "a"'}, "lark", '%llguidance {}\nstart: "a"'),
    ({"regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"response_format": {"type": "text"}}, None, None),
])
@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_each_constraint_field_gives_its_constraint(endpoint: Endpoint, fields: dict[str, Any], kind: str | None,
                                                    text: str | None) -> None:
    pytest.importorskip("llguidance")
    body = ({"prompt": "p"} if endpoint is COMPLETIONS else {"messages": MESSAGES}) | fields
    constraint = CompletionParams.from_body(endpoint, body).constraint
    if kind is None:
        assert constraint is None
        return
    assert constraint is not None and constraint.name == kind
    assert constraint.text == (text if kind != "json_schema" else json.dumps(json.loads(text or "{}"),
                                                                               separators=(",", ":")))
    request = CompletionParams.from_body(endpoint, body).generation_request([1, 2], 64, n_vocab=TOKENIZER.n_vocab)
    assert request.constraint == constraint


@pytest.mark.parametrize(("fields", "param", "match"), [
    ({"response_format": {"type": "xml"}}, "response_format.type", 'must be "text", "json_object" or "json_schema"'),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strictly": 1}}},
     "response_format.json_schema.strictly", "unknown field"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"minLength": -1}}}},
     "response_format.json_schema.schema", r"\$\.minLength: -1 is less than the minimum of 0"),
    ({"response_format": {"type": "json_object", "extra": 1}}, "response_format.extra", "unknown field"),
    ({"json_schema": [1]}, "json_schema", "must be a JSON schema"),
    ({"json_schema": {"type": "string", "format": "x-unknown"}}, "json_schema", "Unknown format: x-unknown"),
    ({"grammar": 5}, "grammar", "must be a string"),
    ({"grammar": "root ::= [a-"}, "grammar", "grammar: "),
    ({"regex": "a", "grammar": 'root ::= "a"'}, "regex", "grammar and regex both constrain the text"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(fields: dict[str, Any], param: str, match: str) -> None:
    pytest.importorskip("llguidance")
    error = refused(CHAT, {"messages": MESSAGES} | fields)
    assert error.param == param
    assert re.search(match, error.message), error.message


# --- tool answers ---------------------------------------------------------------------------------

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _tool_answers() -> Any:
    from skippy_zmq.gateway.openai_api import ToolAnswers
    from skippy_zmq.gateway.tool_calls import Tools
    from skippy_zmq.gateway.tool_formats import ToolFormat

    return ToolAnswers(ToolFormat.HERMES, Tools.from_request(WEATHER_TOOLS))


@pytest.mark.parametrize(("text", "reason", "called", "finish"), [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "eos", True, "tool_calls"),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"', "eos", False, "stop"),  # cut: text
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "eos", False, "stop"),  # unknown tool
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', "length", False, "length"),
    ("It is sunny.", "eos", False, "stop"),
])
def test_a_tool_answer_is_calls_or_text_never_an_error(text: str, reason: str, called: bool, finish: str) -> None:
    result = GenerationResult(prompt="p", prompt_ids=[1], tokens=[5], text=text, finish_reason=reason)
    choice = Choice.of(result, logprobs=False, tools=_tool_answers())
    body = logprob_shape(CHAT).response([choice], Usage(1, 1))
    ChatCompletion.model_validate(body)
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == finish
    if called:
        assert message["content"] is None and json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
            "city": "Oslo"}
    else:
        assert message["content"] == text and "tool_calls" not in message


def test_tool_call_stream_chunks_validate_and_end_with_tool_calls() -> None:
    streams = ChoiceStreams(logprob_shape(CHAT), 1, logprobs=False, tools=_tool_answers())
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    chunks = [chunk for k in range(0, len(text), 7) for chunk in streams.delta(0, text[k:k + 7], ())]
    chunks += streams.ending([GenerationResult(prompt="p", prompt_ids=[1], tokens=[5], text=text,
                                               finish_reason="eos")])
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    assert "".join(d.get("content") or "" for d in deltas).strip() == "Sure."
    pieces = [call for d in deltas for call in d.get("tool_calls", [])]
    assert {p["index"] for p in pieces} == {0} and pieces[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(p["function"]["arguments"] for p in pieces)) == {"city": "Oslo"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_two_assistant_messages_at_the_end_are_refused() -> None:
    """llama-server's rule: a last assistant message is a start the answer continues; two have no reader."""
    user, assistant = {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}
    with pytest.raises(ApiError, match="cannot end with 2 or more assistant messages") as info:
        CompletionParams.from_body(Endpoint.CHAT, {"messages": [user, assistant, assistant]})
    assert info.value.param == "messages"
    assert len(CompletionParams.from_body(Endpoint.CHAT, {"messages": [assistant, user, assistant]}).messages) == 3
