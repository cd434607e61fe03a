"""llama-server's routes, CORS and served model names through the HTTP gateway, in-process: aiohttp's
test client against the fake engine of tests/gateway/fakes.py."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from skippy_zmq.driver.generation import GenerationRequest
from skippy_zmq.gateway.cors import CorsPolicy
from skippy_zmq.gateway.llama_api import NATIVE_FIELDS
from skippy_zmq.gateway.reasoning import DEFAULT_THINKING
from skippy_zmq.gateway.state import AttachedEngine, GatewayState
from skippy_zmq.testing.llama_sources import vocab_cases
from skippy_zmq.tokens.logprobs import TokenLogprobs
from skippy_zmq.tokens.tokenizer import Tokenizer
from tests.gateway.fakes import N_EMBD, STEP_S, TOKENIZER, FakeEngine, Step, render_chat
from tests.gateway.test_http import LiveApp, _warnings, run_client
from tests.strategies import HOSTILE_TEXT, hostile_json, json_text

PAGE = "http://localhost:5173"
KEY = "sk-test"


def _letters(request: GenerationRequest) -> Iterator[Step]:
    """A fake engine's script: "a", "b", ... (their byte tokens) up to max_tokens, each with a logprob and one
    alternative when the request asks."""
    for index in range(request.max_tokens):
        yield ("sleep", STEP_S)
        token = 4 + ord("a") + index  # the byte tokens of "a", "b", ...
        entries = () if request.logprobs is None else (TokenLogprobs(token, -0.5, ((token, -0.5), (1, -2.0))),)
        yield ("delta", chr(ord("a") + index), (token,), 0, entries)
    yield ("sleep", STEP_S)
    yield ("finish", 0, "length")
    yield ("end",)


def backend_of(engine: FakeEngine | None, *, served: tuple[str, ...] = (), strict: bool = False) -> GatewayState:
    backend = GatewayState("/models/tiny-model.gguf", served_names=served, strict_model_name=strict)
    if engine is not None:
        backend.attach(AttachedEngine(engine, TOKENIZER, render_chat, chat_template="{{ messages }}",  # type: ignore[arg-type]
                                      model_path="/models/tiny-model.gguf"))
    return backend


async def post(client: TestClient[Any, Any], path: str, body: Any,
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    response = await client.post(path, data=json.dumps(body), headers={"Content-Type": "application/json",
                                                                         **(headers or {})})
    return response.status, dict(response.headers), await response.text()


def events_of(raw: str) -> list[Any]:
    blocks = [block for block in raw.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in blocks) and "[DONE]" not in raw
    return [json.loads(block.removeprefix("data: ")) for block in blocks]


# --- aliases ------------------------------------------------------------------------------------


def test_unprefixed_aliases_answer_as_llama_server_does() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        assert await (await client.get("/models")).json() == await (await client.get("/v1/models")).json()
        status, _, text = await post(client, "/completions", {"prompt": "hi", "n_predict": 2})
        assert status == 200 and json.loads(text)["content"] == " w0 w1"  # llama-server's native route, as there
        status, _, text = await post(client, "/completions", {"prompt": "hi", "max_tokens": 2})  # n_predict's alias
        assert status == 200 and json.loads(text)["content"] == " w0 w1"
        slots = await client.get("/slots")
        assert slots.status == 501 and (await slots.json())["error"]["type"] == "not_supported_error"
        status, _, text = await post(client, "/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                   "max_tokens": 1})
        assert status == 200 and json.loads(text)["object"] == "chat.completion"

    run_client(backend_of(FakeEngine()), scenario)


# --- llama-server's additions to the OpenAI routes ---------------------------------------------------------


def test_openai_answers_carry_timings_and_with_verbose_the_completion_shape() -> None:
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, text = await post(client, "/v1/chat/completions", chat | {"verbose": True})
        answer = json.loads(text)
        assert status == 200 and answer["timings"]["predicted_n"] == 2 and answer["timings"]["prompt_n"] == 2
        verbose = answer["__verbose"]
        assert verbose["content"] == answer["choices"][0]["message"]["content"] == "ab"
        assert verbose["prompt"] == "<bos>x" and verbose["tokens_predicted"] == 2 and verbose["stop_type"] == "limit"
        status, _, text = await post(client, "/v1/completions", {"prompt": "x", "max_tokens": 2, "verbose": False})
        assert "__verbose" not in json.loads(text) and json.loads(text)["timings"]["predicted_n"] == 2
        status, _, text = await post(client, "/v1/chat/completions", chat | {
            "stream": True, "stream_options": {"include_usage": True}, "verbose": True, "timings_per_token": True})
        assert text.endswith("data: [DONE]\n\n")
        chunks = [json.loads(block.removeprefix("data: ")) for block in text.split("\n\n")[:-2]]
        assert chunks and "timings" not in chunks[0] and all("timings" not in c for c in chunks[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["timings"]["predicted_n"] == 2  # the usage chunk
        finish = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
        assert finish["__verbose"]["content"] == "ab"

    run_client(backend_of(FakeEngine(_letters)), scenario)


def test_chat_post_sampling_probs_are_asked_of_the_engine_and_shown_as_probabilities() -> None:
    engine = FakeEngine(_letters)
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True, "top_logprobs": 2,
            "post_sampling_probs": True}

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, text = await post(client, "/v1/chat/completions", chat)
        (entry,) = json.loads(text)["choices"][0]["logprobs"]["content"]
        assert status == 200 and engine.submitted[-1].request.post_sampling_probs
        assert entry["prob"] == pytest.approx(math.exp(-0.5)) and "logprob" not in entry
        assert [alt["prob"] for alt in entry["top_probs"]] == [pytest.approx(math.exp(-0.5)), pytest.approx(math.exp(-2))]
        status, _, text = await post(client, "/v1/chat/completions", chat | {"post_sampling_probs": False})
        assert "logprob" in json.loads(text)["choices"][0]["logprobs"]["content"][0]
        assert not engine.submitted[-1].request.post_sampling_probs
        status, _, text = await post(client, "/v1/chat/completions", chat | {"logprobs": False, "top_logprobs": None})
        assert status == 200 and not engine.submitted[-1].request.post_sampling_probs  # nothing to show them in
        status, _, text = await post(client, "/v1/completions", {"prompt": "x", "post_sampling_probs": True})
        assert status == 400 and json.loads(text)["error"]["param"] == "post_sampling_probs"
        status, _, text = await post(client, "/v1/chat/completions", chat | {"return_progress": True, "stream": True,
                                                                           "timings_per_token": True})
        request = engine.submitted[-1].request
        assert status == 200 and request.progress and request.timings  # reports: tests/gateway/test_llama_api.py
        status, _, text = await post(client, "/v1/chat/completions", chat | {"return_progress": True})
        assert status == 200 and not engine.submitted[-1].request.progress  # a whole answer has nothing to report
        status, _, text = await post(client, "/v1/chat/completions", chat | {"return_progress": "yes"})
        assert status == 400 and json.loads(text)["error"]["param"] == "return_progress"

    run_client(backend_of(engine), scenario)


def test_serve_verbose_gives_every_openai_answer_its_verbose_unless_the_request_says_false() -> None:
    backend = backend_of(FakeEngine(_letters))
    backend.verbose = True  # serve -v
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}

    async def scenario(client: TestClient[Any, Any]) -> None:
        _, _, text = await post(client, "/v1/chat/completions", chat)
        assert json.loads(text)["__verbose"]["content"] == "ab"
        _, _, text = await post(client, "/v1/chat/completions", chat | {"verbose": False})
        assert "__verbose" not in json.loads(text)

    run_client(backend, scenario)


def test_input_tokens_counts_the_chat_prompt_as_a_request_would_run_it() -> None:
    engine = FakeEngine()
    chat = {"messages": [{"role": "system", "content": "Book"}, {"role": "user", "content": "best"}]}

    async def scenario(client: TestClient[Any, Any]) -> None:
        for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
            status, _, text = await post(client, path, chat)
            assert (status, json.loads(text)) == (200, {"input_tokens": 9, "object": "response.input_tokens"})
        await post(client, "/v1/chat/completions", chat | {"max_tokens": 1})
        assert len(engine.submitted[-1].request.prompt_ids or ()) == 9  # BOS and the 8 characters
        status, _, text = await post(client, "/chat/completions/input_tokens", {"messages": []})
        assert status == 400 and json.loads(text)["error"]["param"] == "messages"

    run_client(backend_of(engine), scenario)


def test_a_final_assistant_message_is_continued_as_llama_server_does() -> None:
    calls: list[dict[str, Any]] = []

    def recording(messages: Any, **given: Any) -> list[int]:
        assert given.pop("thinking") == DEFAULT_THINKING  # every chat renders with its thought settings
        calls.append(given)
        return render_chat(messages)

    backend = GatewayState("/models/tiny-model.gguf")
    backend.attach(AttachedEngine(FakeEngine(), TOKENIZER, recording))  # type: ignore[arg-type]
    user, prefill = {"role": "user", "content": "x"}, {"role": "assistant", "content": "Wh"}

    async def scenario(client: TestClient[Any, Any]) -> None:
        cases = [({"messages": [user, prefill]}, {"add_generation_prompt": False, "continue_final": True}),
                 ({"messages": [user, prefill], "continue_final_message": True, "add_generation_prompt": False},
                  {"add_generation_prompt": False, "continue_final": True}),
                 ({"messages": [user], "add_generation_prompt": False},
                  {"add_generation_prompt": False, "continue_final": False}),
                 ({"messages": [user, prefill], "continue_final_message": False}, {}),
                 ({"messages": [user]}, {})]
        for body, passed in cases:
            status, _, text = await post(client, "/v1/chat/completions", body | {"max_tokens": 1})
            assert status == 200 and calls[-1] == passed, (body, text)
        for body, where in (({"messages": [user, prefill], "continue_final_message": True}, "cannot both be true"),
                            ({"messages": [user], "continue_final_message": "content", "add_generation_prompt": False},
                             "needs the last message to be the assistant's"),
                            ({"messages": [user, prefill], "continue_final_message": "reasoning_content"},
                             "is not supported"),
                            ({"messages": [user, prefill], "continue_final_message": 1}, "must be true, false"),
                            ({"messages": [user, prefill | {"tool_calls": [{"id": "c", "type": "function", "function": {
                                "name": "f", "arguments": "{}"}}]}]}, "holds tool_calls")):
            status, _, text = await post(client, "/v1/chat/completions", body)
            error = json.loads(text)["error"]
            assert status == 400 and error["param"] == "continue_final_message" and where in error["message"], text

    run_client(backend, scenario)


def test_a_batch_of_prompts_on_v1_completions_answers_one_choice_each() -> None:
    engine = FakeEngine(_letters)

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, text = await post(client, "/v1/completions", {"prompt": ["x", [4, 5, 6]], "max_tokens": 2})
        answer = json.loads(text)
        assert status == 200 and [(c["index"], c["text"]) for c in answer["choices"]] == [(0, "ab"), (1, "ab")]
        assert answer["usage"]["prompt_tokens"] == 2 + 3 and answer["usage"]["completion_tokens"] == 4
        assert [s.request.prompt_ids for s in engine.submitted[-2:]] == [(2, 4 + ord("x")), (4, 5, 6)]
        status, _, text = await post(client, "/v1/completions", {"prompt": ["x", "y"], "max_tokens": 2, "stream": True,
                                                                  "stream_options": {"include_usage": True}})
        assert text.endswith("data: [DONE]\n\n")
        chunks = [json.loads(block.removeprefix("data: ")) for block in text.split("\n\n")[:-2]]
        texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
                 for i in (0, 1)}
        assert texts == {0: "ab", 1: "ab"} and chunks[-1]["usage"]["prompt_tokens"] == 4
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
                ] == ["length", "length"]
        before = len(engine.submitted)
        status, _, text = await post(client, "/v1/completions", {"prompt": ["x", [-1]]})
        assert status == 400 and json.loads(text)["error"]["param"] == "prompt[1]" and len(engine.submitted) == before
        status, _, text = await post(client, "/v1/completions", {"prompt": ["x", "y"], "n": 2})
        assert status == 400 and json.loads(text)["error"]["param"] == "n"

    run_client(backend_of(engine), scenario)


def test_n_predict_on_the_openai_routes_runs_up_to_the_context() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        for n_predict, expected in ((1000, 62), (-1, 62), (3, 3)):
            status, _, text = await post(client, "/v1/completions", {"prompt": "x", "n_predict": n_predict})
            assert status == 200 and engine.submitted[-1].request.max_tokens == expected, text
        status, _, text = await post(client, "/v1/completions", {"prompt": "x", "n_predict": 0})
        assert status == 400 and json.loads(text)["error"]["param"] == "n_predict"
        status, _, text = await post(client, "/v1/completions", {"prompt": "x", "n_predict": 9, "max_tokens": 2})
        assert status == 200 and engine.submitted[-1].request.max_tokens == 2  # max_tokens wins

    run_client(backend_of(engine), scenario)


# --- /tokenize, /detokenize, /props ------------------------------------------------------------


def test_tokenize_detokenize_and_props_over_http() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, text = await post(client, "/tokenize", {"content": "<bos>a\u00e1", "with_pieces": True})
        assert status == 200
        assert json.loads(text) == {"tokens": [{"id": 2, "piece": "<bos>"}, {"id": 4 + 97, "piece": "a"},
                                               {"id": 4 + 0xC3, "piece": [0xC3]}, {"id": 4 + 0xA1, "piece": [0xA1]}]}
        status, _, text = await post(client, "/tokenize", {"content": "ab", "add_special": True})
        assert json.loads(text) == {"tokens": [2, 4 + 97, 4 + 98]}
        status, _, text = await post(client, "/detokenize", {"tokens": [4 + 97, 4 + 98]})
        assert (status, json.loads(text)) == (200, {"content": "ab"})
        status, _, text = await post(client, "/detokenize", {"tokens": [4, TOKENIZER.n_vocab]})
        assert status == 400 and json.loads(text)["error"]["param"] == "tokens"
        props = await (await client.get("/props")).json()
        assert props["model_path"] == "/models/tiny-model.gguf" and props["chat_template"] == "{{ messages }}"
        assert props["total_slots"] == engine.max_sessions and props["default_generation_settings"]["n_ctx"] == 64

    run_client(backend_of(engine), scenario)


def test_the_tokenizer_routes_are_503_while_starting() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        for path, body in (("/tokenize", {"content": "x"}), ("/detokenize", {"tokens": [4]})):
            status, headers, text = await post(client, path, body)
            assert status == 503 and headers["Retry-After"] and "starting" in text
        assert (await client.get("/props")).status == 503

    run_client(backend_of(None), scenario)


# --- /completion --------------------------------------------------------------------------------


def test_completion_answers_in_llama_servers_shape_with_its_defaults() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, text = await post(client, "/completion", {"prompt": "<pad>ab", "n_predict": 3, "seed": 5,
                                                             "repeat_last_n": 8, "cache_prompt": True})
        assert status == 200, text
        answer = json.loads(text)
        assert answer["content"] == " w0 w1 w2" and answer["stop"] is True and answer["stop_type"] == "limit"
        assert answer["tokens_predicted"] == 3 and answer["tokens_evaluated"] == 4  # BOS, <pad> parsed
        assert answer["model"] == "tiny-model" and answer["generation_settings"]["seed"] == 5
        request = engine.submitted[-1].request
        assert request.prompt_ids == (2, 0, 4 + 97, 4 + 98) and request.max_tokens == 3
        sampling = request.sampling
        assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p) == (0.8, 40, 0.95, 0.05)
        assert sampling.penalty_last_n == 8 and request.logprobs is None
        # n_predict -1 (the default), or more than fits, runs up to the context instead of a 400
        for body in ({"prompt": [4, 5]}, {"prompt": [4, 5], "n_predict": 1000}):
            status, _, text = await post(client, "/completion", body | {"n_predict": body.get("n_predict", -1)})
            assert status == 200 and engine.submitted[-1].request.max_tokens == 62, text

    run_client(backend_of(engine), scenario)


def test_completion_streams_pieces_then_the_totals_without_done() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        status, headers, text = await post(client, "/completion", {"prompt": "x", "n_predict": 2, "stream": True,
                                                                   "n_probs": 2})
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        events = events_of(text)
        assert [e["content"] for e in events] == ["a", "b", ""] and [e["stop"] for e in events] == [False, False, True]
        assert events[0]["tokens"] == [4 + 97] and events[1]["tokens_predicted"] == 2
        top = events[0]["completion_probabilities"][0]
        assert (top["id"], top["token"], top["logprob"], top["bytes"]) == (4 + 97, "a", -0.5, [97])
        assert [alt["id"] for alt in top["top_logprobs"]] == [4 + 97, 1]
        assert events[-1]["stop_type"] == "limit" and events[-1]["tokens_predicted"] == 2

    run_client(backend_of(FakeEngine(_letters)), scenario)


def test_completion_with_n_probs_asks_for_logprobs_and_answers_them() -> None:
    engine = FakeEngine(_letters)

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, text = await post(client, "/completion", {"prompt": "x", "n_predict": 2, "n_probs": 3,
                                                             "return_tokens": True})
        answer = json.loads(text)
        assert status == 200 and engine.submitted[-1].request.logprobs == 3
        assert [entry["token"] for entry in answer["completion_probabilities"]] == ["a", "b"]
        assert answer["tokens"] == [4 + 97, 4 + 98]

    run_client(backend_of(engine), scenario)


def test_a_batch_of_prompts_runs_one_request_each_and_answers_an_array() -> None:
    engine = FakeEngine(_letters)

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, text = await post(client, "/completion", {"prompt": [[4, 5], "x", {"prompt_string": "y"}],
                                                             "n_predict": 2, "response_fields": ["index", "content"]})
        assert status == 200, text
        assert json.loads(text) == [{"index": 0, "content": "ab"}, {"index": 1, "content": "ab"},
                                    {"index": 2, "content": "ab"}]
        prompts = [submitted.request.prompt_ids for submitted in engine.submitted[-3:]]
        assert prompts[0] == (4, 5) and prompts[1] != prompts[2]
        status, _, text = await post(client, "/completion", {"prompt": ["x", "y"], "n_predict": 2, "stream": True})
        events = events_of(text)
        assert sorted((e["index"], e["content"]) for e in events if not e["stop"]) == [(0, "a"), (0, "b"), (1, "a"),
                                                                                       (1, "b")]
        assert sorted(e["index"] for e in events if e["stop"]) == [0, 1]
        before = len(engine.submitted)
        status, _, text = await post(client, "/completion", {"prompt": ["x", [TOKENIZER.n_vocab]]})
        assert status == 400 and len(engine.submitted) == before, text  # nothing runs when one prompt is bad

    run_client(backend_of(engine), scenario)


@pytest.mark.parametrize(("body", "param"), [
    ({}, "prompt"), ({"prompt": "x", "n_predict": -5}, "n_predict"), ({"prompt": "x", "n_probs": 99}, "n_probs"),
    ({"prompt": "x", "top_p": 2}, "top_p"), ({"prompt": "x", "grammar": "root ::= x"}, "grammar"),
    ({"prompt": [TOKENIZER.n_vocab]}, "prompt"), ({"prompt": "x", "stop": "y", "stream": 1}, "stream"),
])
def test_bad_completion_bodies_are_400s_naming_the_field(body: dict[str, Any], param: str) -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, text = await post(client, "/completion", body)
        error = json.loads(text)["error"]
        assert (status, error["param"]) == (400, param) and param in error["message"]
        assert engine.submitted == []

    run_client(backend_of(engine), scenario)


# --- served names -------------------------------------------------------------------------------


def test_served_names_the_first_is_the_id_and_each_is_accepted() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        models = await (await client.get("/v1/models")).json()
        assert [entry["id"] for entry in models["data"]] == ["tiny"]
        for name in ("tiny", "org/tiny"):
            assert (await client.get(f"/v1/models/{name}")).status == 200
            for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                               ("/completion", {"prompt": "x", "n_predict": 1})):
                status, _, text = await post(client, path, body | {"model": name})
                assert status == 200 and json.loads(text)["model"] == "tiny", text
        for path in ("/v1/completions", "/completion"):
            status, _, text = await post(client, path, {"prompt": "x", "model": "tiny-model"})
            assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
        assert (await client.get("/v1/models/tiny-model")).status == 404

    run_client(backend_of(FakeEngine(), served=("tiny", "org/tiny", "tiny"), strict=True), scenario)


def test_any_model_name_is_answered_by_the_served_model() -> None:
    """llama-server's behaviour: clients hard-code OpenAI's names; every route answers with the served model."""

    async def scenario(client: TestClient[Any, Any]) -> None:
        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
                           ("/completion", {"prompt": "x", "n_predict": 1}),
                           ("/v1/embeddings", {"input": "x"})):
            status, _, text = await post(client, path, body | {"model": "gpt-3.5-turbo"})
            assert status == 200 and json.loads(text)["model"] == "tiny", (path, text)
        models = await (await client.get("/v1/models")).json()
        assert [entry["id"] for entry in models["data"]] == ["tiny"]
        assert (await client.get("/v1/models/gpt-3.5-turbo")).status == 404  # a lookup, not a request to serve

    engine = FakeEngine()
    backend = backend_of(engine, served=("tiny",))
    backend.attach(AttachedEngine(engine, TOKENIZER, render_chat, n_embd=N_EMBD))  # type: ignore[arg-type]
    run_client(backend, scenario)


# --- CORS ---------------------------------------------------------------------------------------


def preflight_headers(origin: str) -> dict[str, str]:
    return {"Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"}


def test_a_preflight_is_answered_without_the_api_key_for_an_allowed_origin_only() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        for path in ("/v1/chat/completions", "/tokenize", "/no/such/path"):
            response = await client.options(path, headers=preflight_headers(PAGE))
            assert response.status == 204, path
            assert response.headers["Access-Control-Allow-Origin"] == PAGE
            assert response.headers["Access-Control-Allow-Headers"] == "authorization,content-type"
            assert "POST" in response.headers["Access-Control-Allow-Methods"]
            assert response.headers["Vary"] == "Origin" and int(response.headers["Access-Control-Max-Age"]) > 0
        other = await client.options("/v1/completions", headers=preflight_headers("https://evil.test"))
        assert other.status == 403 and (await other.json())["error"]["code"] == "cors_origin_not_allowed"
        assert not any(name.startswith("Access-Control") for name in other.headers)
        plain = await client.options("/v1/completions")  # no Origin: not a preflight, and the key is needed
        assert plain.status == 401

    run_client(backend_of(FakeEngine()), scenario, api_key=KEY, cors=CorsPolicy.parse(PAGE))


def test_every_answer_to_an_allowed_origin_carries_its_headers_and_others_get_none() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        auth = {"Authorization": f"Bearer {KEY}"}
        for origin, allowed in ((PAGE, True), ("https://evil.test", False)):
            answers = [
                await client.get("/v1/models", headers={"Origin": origin, **auth}),
                await client.get("/v1/models", headers={"Origin": origin}),  # 401
                await client.get("/nothing", headers={"Origin": origin, **auth}),  # 404
                await client.get("/health", headers={"Origin": origin}),
                await client.post("/completion", data=json.dumps({"prompt": "x", "n_predict": 2, "stream": True}),
                                  headers={"Origin": origin, **auth}),
                await client.post("/v1/completions", data=json.dumps({"prompt": "x", "max_tokens": 2, "stream": True}),
                                  headers={"Origin": origin, **auth}),
            ]
            assert [a.status for a in answers] == [200, 401, 404, 200, 200, 200]
            for answer in answers:
                await answer.read()
                assert answer.headers.get("Access-Control-Allow-Origin") == (origin if allowed else None), answer.url
                assert (answer.headers.get("Vary") == "Origin") is allowed

    run_client(backend_of(FakeEngine()), scenario, api_key=KEY, cors=CorsPolicy.parse(PAGE))


def test_without_cors_origins_no_answer_has_cors_headers() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        response = await client.options("/v1/completions", headers=preflight_headers(PAGE))
        assert response.status == 403
        answer = await client.get("/v1/models", headers={"Origin": PAGE})
        assert answer.status == 200 and "Access-Control-Allow-Origin" not in answer.headers

    run_client(backend_of(FakeEngine()), scenario)


# --- any JSON, through the app -----------------------------------------------------------------


@pytest.fixture(scope="module")
def live_app() -> Iterator[LiveApp]:
    app = LiveApp()
    try:
        yield app
    finally:
        app.close()


_KEYS = [*NATIVE_FIELDS, "content", "tokens", "add_special", "with_pieces", "parse_special"]
_BODIES = (
    st.fixed_dictionaries({"prompt": HOSTILE_TEXT}, optional={"n_predict": st.integers(-2, 4), "stream": st.booleans(),
                                                             "n_probs": st.integers(-1, 21)}).map(
        lambda body: json_text(body).encode())
    | hostile_json(_KEYS, {"prompt": HOSTILE_TEXT}, extra=1)
    | hostile_json(_KEYS, {"content": HOSTILE_TEXT}, extra=1)
    | hostile_json(_KEYS, {"tokens": st.lists(st.integers(-2, 300), max_size=4)}, extra=1)
    | hostile_json(_KEYS)
)


@given(path=st.sampled_from(["/completion", "/tokenize", "/detokenize"]), data=_BODIES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_hostile_body_on_the_llama_routes_gets_a_200_or_a_4xx(
    live_app: LiveApp, caplog: pytest.LogCaptureFixture, path: str, data: bytes,
) -> None:
    status, body = live_app.post(path, data)
    event(f"{path} {status}")
    text = body.decode("utf-8")  # strict: the answer is valid text
    assert status == 200 or 400 <= status < 500, (status, text[:300])
    if status != 200:
        assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    elif text.startswith("data: "):
        assert events_of(text)[-1]["stop"] is True
    else:
        json.loads(text)
    assert _warnings(caplog) == []


# --- /apply-template ------------------------------------------------------------------------------


def test_apply_template_renders_messages_and_tools_with_or_without_the_generation_prompt() -> None:
    from skippy_zmq.gateway.chat import ChatTemplate
    from skippy_zmq.testing.llama_sources import template_files

    source = next(path for path in template_files() if path.stem == "meta-llama-Llama-3.3-70B-Instruct").read_text()
    tokenizer = Tokenizer.from_gguf(next(c.path for c in vocab_cases() if c.name == "llama-bpe"))
    template = ChatTemplate.from_source(source, tokenizer)
    backend = GatewayState("/models/tiny-model.gguf")
    backend.attach(AttachedEngine(FakeEngine(), TOKENIZER, render_chat,  # type: ignore[arg-type]
                                  render_prompt=template.render_text))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "What is today?"}]
    header = "<|start_header_id|>assistant<|end_header_id|>"

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, text = await post(client, "/apply-template", {"messages": messages, "tools": tools})
        assert status == 200 and json.loads(text)["prompt"].endswith(header + "\n\n")
        assert '"get_weather"' in json.loads(text)["prompt"]
        status, _, text = await post(client, "/apply-template", {"messages": messages, "add_generation_prompt": False})
        assert status == 200 and header not in json.loads(text)["prompt"]
        prefilled = [*messages, {"role": "assistant", "content": "Whill"}]  # continued, as chat continues it
        status, _, text = await post(client, "/apply-template", {"messages": prefilled})
        assert status == 200 and json.loads(text)["prompt"].endswith(header + "\n\nWhill")
        status, _, text = await post(client, "/apply-template", {"messages": prefilled, "continue_final_message": True})
        assert status == 400 and json.loads(text)["error"]["param"] == "continue_final_message"
        status, _, text = await post(client, "/apply-template", {"messages": []})
        assert status == 400 and json.loads(text)["error"]["param"] == "messages"
        status, _, text = await post(client, "/apply-template", {"messages": [{"role": "robot", "content": "x"}]})
        assert status == 400 and "role" in json.loads(text)["error"]["message"]
        status, _, text = await post(client, "/apply-template", {"messages": messages, "tools": [{"type": "x"}]})
        assert status == 400 and json.loads(text)["error"]["param"].startswith("tools[0]")

    run_client(backend, scenario)
