"""Vertex AI's prediction protocol (skippy_zmq/gateway/vertex_api.py, the route in http.py): settings from
the environment, instance validation in-process, and the route over the fake engine, each instance answered
by the route it names, errors in its place."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from skippy_zmq.errors import ConfigError
from skippy_zmq.gateway.openai_api import ApiError
from skippy_zmq.gateway.options import ServeOptions, VertexSettings
from skippy_zmq.gateway.vertex_api import MAX_INSTANCES, format_table, instance_request, instances_of, request_format
from tests.gateway.fakes import FakeEngine
from tests.gateway.test_http import make_backend, post, run_client

VERTEX = VertexSettings(enabled=True, health_route="/ping", port=8080)


def test_the_environment_turns_the_protocol_on_and_names_its_routes() -> None:
    assert VertexSettings.from_env({}) == VertexSettings()
    assert VertexSettings.from_env({"AIP_MODE": "PREDICTION"}) == VertexSettings(True, "/predict", None, 8080)
    assert VertexSettings.from_env({"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "9000", "AIP_PREDICT_ROUTE": "go",
                                    "AIP_HEALTH_ROUTE": "/ready"}) == VertexSettings(True, "/go", "/ready", 9000)
    for env, message in (({"AIP_HTTP_PORT": "http"}, "AIP_HTTP_PORT 'http' is not a TCP port"),
                         ({"AIP_HTTP_PORT": "0"}, "AIP_HTTP_PORT '0'"),
                         ({"AIP_PREDICT_ROUTE": "/a b"}, "AIP_PREDICT_ROUTE '/a b' is not a URL path")):
        with pytest.raises(ConfigError, match=message):
            VertexSettings.from_env({"AIP_MODE": "PREDICTION", **env})
    assert ServeOptions(vertex=VertexSettings.from_env({"AIP_MODE": "PREDICTION"})).vertex.enabled


def test_request_formats_are_the_routes_camel_case_names() -> None:
    assert request_format("/v1/chat/completions") == "chatCompletions"
    assert request_format("/apply-template") == "applyTemplate"
    assert request_format("/v1/messages/count_tokens") == "messagesCountTokens"
    table = format_table(["/v1/chat/completions", "/chat/completions", "/completion"])
    assert table["chatCompletions"] == "/v1/chat/completions" and table["/chat/completions"] == "/chat/completions"


@pytest.mark.parametrize(("body", "param"), [
    ([], None), ({"instances": {}}, "instances"), ({"instances": [{}] * (MAX_INSTANCES + 1)}, "instances"),
])
def test_a_bad_prediction_body_is_a_400_naming_it(body: Any, param: str | None) -> None:
    with pytest.raises(ApiError) as caught:
        instances_of(body)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_an_instance_names_its_route_and_never_streams() -> None:
    formats = format_table(["/v1/completions"])
    path, body = instance_request({"@requestFormat": "completions", "prompt": "x", "stream": True}, 0, formats)
    assert (path, body) == ("/v1/completions", b'{"prompt": "x", "stream": false}')
    for instance, message in ((3, r"instances\[1\] must be a JSON object"),
                              ({"prompt": "x"}, "needs a string @requestFormat"),
                              ({"@requestFormat": "fly"}, "no route for @requestFormat 'fly'; known: completions")):
        with pytest.raises(ApiError, match=message):
            instance_request(instance, 1, formats)


def test_the_prediction_route_answers_every_instance_in_order() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, body = await post(client, "/predict", {"instances": [
            {"@requestFormat": "completions", "prompt": "hello", "max_tokens": 3},
            {"@requestFormat": "chatCompletions", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
             "stream": True},
            {"@requestFormat": "/tokenize", "content": "ab"},
            {"@requestFormat": "completions", "prompt": "x", "max_tokens": 0},
            {"prompt": "no format"},
        ]})
        assert status == 200
        first, chat, tokens, bad, unnamed = body["predictions"]
        assert first["object"] == "text_completion" and first["usage"]["completion_tokens"] == 3
        assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
        assert tokens == {"tokens": [101, 102]}  # the byte tokenizer: a byte b is id b + 4
        assert bad["error"]["param"] == "max_tokens" and bad["error"]["type"] == "invalid_request_error"
        assert "@requestFormat" in unnamed["error"]["message"]
        async with client.get("/ping") as response:
            assert response.status == 200

    run_client(make_backend(FakeEngine()), scenario, vertex=VERTEX)


def test_the_routes_exist_only_in_prediction_mode_and_the_health_path_needs_no_key() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        async with client.post("/predict", json={"instances": []}) as response:
            assert response.status == 401  # the prediction route itself needs the key
        async with client.get("/ping") as response:
            assert response.status == 200

    run_client(make_backend(FakeEngine()), scenario, vertex=VERTEX, api_key="k")

    async def off(client: TestClient[Any, Any]) -> None:
        status, _, _ = await post(client, "/predict", {"instances": []})
        assert status == 404

    run_client(make_backend(FakeEngine()), off)
