"""In-process tests of the HTTP gateway (skippy_zmq.gateway.http) over a fake engine.

The app runs on aiohttp's TestServer (loopback, in this process); clients are aiohttp's and the
official `openai` package's async client. The fake engine (tests/gateway/fakes.py, its default
script) emits its events from its own threads, like the real one.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import logging
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from http.client import HTTPConnection
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from skippy_zmq.driver.engine import Delta
from skippy_zmq.driver.generation import GenerationRequest, GenerationResult
from skippy_zmq.driver.lanes import Liveness
from skippy_zmq.driver.watch import LinkTrouble, RecoveryView, StagePlace, StageWatch
from skippy_zmq.errors import QueueFull, RemoteStageError, RequestError, RequestTimeout, SkippyError
from skippy_zmq.gateway import http
from skippy_zmq.gateway.embedding_api import check_per_token_size
from skippy_zmq.gateway.metrics import GatewayMetrics
from skippy_zmq.gateway.openai_api import FIELDS, ApiError, CompletionParams, Endpoint
from skippy_zmq.gateway.state import AttachedEngine, ClientLimiter, GatewayState, model_id
from skippy_zmq.tokens.pooling import Pooling
from skippy_zmq.wire.replies import MAX_EMBEDDING_VALUES
from tests.gateway.fakes import N_EMBD, TOKENIZER, FakeEngine, fake_vector, render_chat
from tests.strategies import HOSTILE_TEXT, HUGE_INTEGERS, hostile_json, json_text

WAIT_S = 5.0


@pytest.fixture(autouse=True)
def _package_records_reach_caplog(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve's log (tests of the server) stops the package's records at its logger; here they must reach caplog."""
    monkeypatch.setattr(logging.getLogger("skippy_zmq"), "propagate", True)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The package's and aiohttp's records at WARNING or above (not the leftovers of other tests' loops), but
    for the once-per-field notes of ignored fields (a client's `user`, docs/PROTOCOL.md §9.2)."""
    return [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(("skippy_zmq", "aiohttp"))
            and "which this server accepts and ignores" not in r.getMessage()]


def make_backend(engine: FakeEngine | None = None, *, chat: bool = True) -> GatewayState:
    backend = GatewayState("/models/tiny-model.gguf")
    if engine is not None:
        backend.attach(AttachedEngine(engine, TOKENIZER, render_chat if chat else None,  # type: ignore[arg-type]
                                      n_embd=N_EMBD))
    return backend


def run_client(backend: GatewayState, scenario: Callable[[TestClient[Any, Any]], Awaitable[None]],
               metrics: GatewayMetrics | None = None, **app_options: Any) -> None:
    """Serve `backend` in-process (`app_options` go to make_app) and run `scenario` against it (bounded)."""

    async def main() -> None:
        app = http.make_app(backend, metrics or GatewayMetrics(), **app_options)
        server = TestServer(app)
        await server.start_server(**http.server_options())  # as serve's AppRunner
        async with TestClient(server) as client:
            await asyncio.wait_for(scenario(client), 30)

    asyncio.run(main())


def openai_client(client: TestClient[Any, Any]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0, timeout=WAIT_S)


async def wait_until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def post(client: TestClient[Any, Any], path: str, body: Any) -> tuple[int, dict[str, Any], Any]:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    response = await client.post(path, data=data, headers={"Content-Type": "application/json"})
    return response.status, dict(response.headers), await response.json()


def sse_events(raw: str) -> list[Any]:
    events = [block.removeprefix("data: ") for block in raw.split("\n\n") if block]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


# --- health and models ---------------------------------------------------------------------------


def test_model_id_rule() -> None:
    assert model_id("gemma3-270m-q4_k_m") == "gemma3-270m-q4_k_m"
    assert model_id("/a/b/Tiny.Model.GGUF") == "Tiny.Model"
    assert model_id("relative/m.gguf") == "m"
    assert model_id("noext") == "noext"


@pytest.mark.parametrize(("setup", "status", "state"), [
    ("starting", 503, "starting"),
    ("silent", 503, "waiting"),
    ("ready", 200, "ok"),
    ("draining", 503, "draining"),
])
def test_health(setup: str, status: int, state: str) -> None:
    engine = FakeEngine()
    backend = make_backend(None if setup == "starting" else engine)
    backend.status = "starting: loading stages"
    if setup == "silent":
        engine.ready, engine.silent = False, ('stage 1 "stage-1" (layers 2..4)',)
    if setup == "draining":
        backend.begin_drain()

    async def scenario(client: TestClient[Any, Any]) -> None:
        response = await client.get("/health")
        body = await response.json()
        assert (response.status, body["status"], body["model"]) == (status, state, "tiny-model")
        if setup == "starting":
            assert body["message"] == "starting: loading stages"
        if setup == "silent":
            assert body["silent_stages"] == ['stage 1 "stage-1" (layers 2..4)']
            assert "stage-1" in body["message"]

    run_client(backend, scenario)


def test_models() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        models = await openai_client(client).models.list()
        assert [model.id for model in models.data] == ["tiny-model"]
        response = await client.get("/v1/models")
        entry = (await response.json())["data"][0]
        assert (entry["owned_by"], entry["context_length"], entry["object"]) == ("skippy-zmq", 64, "model")
        assert (await openai_client(client).models.retrieve("tiny-model")).id == "tiny-model"
        missing = await client.get("/v1/models/other")
        assert missing.status == 404 and (await missing.json())["error"]["code"] == "model_not_found"

    run_client(make_backend(FakeEngine()), scenario)


def test_json_nested_too_deeply_is_a_400() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        response = await client.post("/v1/completions", data=b"[" * 200_000, headers={"Content-Type": "application/json"})
        assert response.status == 400 and "nests JSON too deeply" in (await response.json())["error"]["message"]

    run_client(make_backend(FakeEngine()), scenario)


# --- generations ---------------------------------------------------------------------------------


def test_completion_with_the_openai_client() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        out = await openai_client(client).completions.create(model="tiny-model", prompt="hi", max_tokens=3, seed=4)
        assert out.choices[0].text == " w0 w1 w2"
        assert out.choices[0].finish_reason == "length"
        assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == "tiny-model"
        assert out.usage is not None
        assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 3, 6)

    run_client(make_backend(engine), scenario)
    request = engine.submitted[0].request
    assert (request.prompt, request.prompt_ids, request.max_tokens, request.sampling.seed) == ("hi", (2, 108, 109), 3, 4)


def test_completion_defaults_and_token_prompt() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, body = await post(client, "/v1/completions", {"prompt": [5, 6, 7]})
        assert status == 200
        assert body["choices"][0]["text"] == "".join(f" w{i}" for i in range(16))

    run_client(make_backend(engine), scenario)
    assert engine.submitted[0].request.prompt_ids == (5, 6, 7)
    assert engine.submitted[0].request.max_tokens == 16


def test_chat_with_the_openai_client() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        out = await openai_client(client).chat.completions.create(
            model="tiny-model", messages=[{"role": "user", "content": "yo"}], max_completion_tokens=2
        )
        assert out.choices[0].message.content == " w0 w1"
        assert out.choices[0].message.role == "assistant"
        assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"

    run_client(make_backend(engine), scenario)
    assert engine.submitted[0].request.prompt_ids == (2, 125, 115)


def test_chat_defaults_to_the_context() -> None:
    engine = FakeEngine(ctx_size=20)

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, body = await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})
        assert status == 200 and body["usage"]["completion_tokens"] == 18

    run_client(make_backend(engine), scenario)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_equals_whole_text(endpoint: str) -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        api = openai_client(client)
        if endpoint == "completions":
            whole = (await api.completions.create(model="tiny-model", prompt="x", max_tokens=5)).choices[0].text
            stream = await api.completions.create(model="tiny-model", prompt="x", max_tokens=5, stream=True,
                                                  stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            text = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        else:
            messages: Any = [{"role": "user", "content": "x"}]
            whole = (await api.chat.completions.create(model="tiny-model", messages=messages, max_tokens=5)
                     ).choices[0].message.content
            stream = await api.chat.completions.create(model="tiny-model", messages=messages, max_tokens=5,
                                                       stream=True, stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
            assert chunks[0].choices[0].delta.role == "assistant"
        assert text == whole == " w0 w1 w2 w3 w4"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 5
        assert all(chunk.usage is None for chunk in chunks[:-1])

    run_client(make_backend(FakeEngine()), scenario)


def test_raw_stream_framing() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await response.text())
        assert [event["choices"][0]["text"] for event in events] == [" w0", " w1", ""]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert "usage" not in events[0]

    run_client(make_backend(FakeEngine()), scenario)


def test_failure_mid_stream_is_an_error_event_then_done() -> None:
    engine = FakeEngine()
    engine.failure, engine.fail_after = RemoteStageError("stage 1 failed"), 2

    async def scenario(client: TestClient[Any, Any]) -> None:
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True})
        events = sse_events(await response.text())
        assert [event.get("choices", [{}])[0].get("text") for event in events[:2]] == [" w0", " w1"]
        assert events[-1] == {"error": {"message": "stage 1 failed", "type": "server_error", "param": None,
                                        "code": "internal_error"}}

    run_client(make_backend(engine), scenario)


@pytest.mark.parametrize(("failure", "status", "code"), [
    (RequestTimeout("late"), 504, "request_timeout"),
    (RemoteStageError("boom"), 500, "internal_error"),
    (RequestError("prompt leaves no room"), 400, None),
])
def test_failure_of_a_whole_request(failure: SkippyError, status: int, code: str | None) -> None:
    engine = FakeEngine()
    engine.failure = failure

    async def scenario(client: TestClient[Any, Any]) -> None:
        got, _, body = await post(client, "/v1/completions", {"prompt": "x"})
        assert (got, body["error"]["code"], body["error"]["message"]) == (status, code, str(failure))

    run_client(make_backend(engine), scenario)


# --- errors before anything runs -----------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), [
    ("/v1/completions", {"prompt": "x", "n": 3}, 400, "n", None),  # the fake pipeline has 2 lanes
    ("/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus", None),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"260": 1}}, 400, "logit_bias", None),  # n_vocab 260
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, 400, "dimensions", None),  # n_embd is 4
    ("/v1/embeddings", {"input": []}, 400, "input", None),
    ("/v1/embeddings", {"input": ["a", 5]}, 400, "input[1]", None),
    ("/v1/embeddings", {"input": [[1], [999]]}, 400, "input[1]", None),
    ("/v1/embeddings", {"input": ["a", "x" * 70]}, 400, "input[1]", "context_length_exceeded"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, 400, "encoding_format", None),
    ("/v1/embeddings", {"input": "x", "bogus": 1}, 400, "bogus", None),
    ("/v1/embeddings", {}, 400, "input", None),
    ("/v1/completions", b"{not json", 400, None, None),
    ("/v1/completions", b"\xff\xfe", 400, None, None),
    ("/v1/completions", [1, 2], 400, None, None),
    ("/v1/completions", {"prompt": "x" * 70}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x" * 200_000}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 63}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"prompt": [999]}, 400, "prompt", None),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": "x"}, 400, "messages", None),
    # what reached a 500 before (PROTOCOL §9.3): integers beyond Python's 4,300 digits, lone surrogates
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, "max_tokens", None),
    ("/v1/completions", b'{"prompt": "x", "bogus": ' + b"9" * 5000 + b"}", 400, "bogus", None),
    ("/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt", None),
    ("/v1/completions", b'{"prompt": "x", "a\\ud800b": 1}', 400, "a\\ud800b", None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
     "messages[0].content", None),
])
def test_request_errors(path: str, body: Any, status: int, param: str | None, code: str | None) -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        got, _, answer = await post(client, path, body)
        assert (got, answer["error"]["param"], answer["error"]["code"]) == (status, param, code)
        if code == "context_length_exceeded":  # llama-server's type and fields, OpenAI's code
            assert answer["error"]["type"] == "exceed_context_size_error"
            assert answer["error"]["n_ctx"] == 64 and answer["error"]["n_prompt_tokens"] > 0
            del answer["error"]["n_ctx"], answer["error"]["n_prompt_tokens"]
        assert set(answer["error"]) == {"message", "type", "param", "code"}

    run_client(make_backend(engine), scenario)
    assert engine.submitted == []


def test_errors_through_the_openai_client() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        api = openai_client(client)
        with pytest.raises(openai.BadRequestError) as bad:
            await api.completions.create(model="tiny-model", prompt="x", n=3)
        assert bad.value.param == "n"
        assert (await api.completions.create(model="gpt-3.5-turbo-instruct", prompt="x")).model == "tiny-model"
        with pytest.raises(openai.BadRequestError) as long:
            await api.completions.create(model="tiny-model", prompt="x" * 100)
        assert long.value.code == "context_length_exceeded"
        engine.refuse = QueueFull("queue full")
        with pytest.raises(openai.RateLimitError):
            await api.completions.create(model="tiny-model", prompt="x")
        engine.refuse, engine.ready = None, False
        with pytest.raises(openai.InternalServerError) as unavailable:
            await api.completions.create(model="tiny-model", prompt="x")
        assert unavailable.value.status_code == 503

    run_client(make_backend(engine), scenario)


def test_chat_without_a_template_is_a_400() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, body = await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert (status, body["error"]["param"]) == (400, "messages")
        assert "chat template" in body["error"]["message"]

    run_client(make_backend(FakeEngine(), chat=False), scenario)


@pytest.mark.parametrize("state", ["starting", "silent", "draining"])
def test_503_with_retry_after_until_ready(state: str) -> None:
    engine = FakeEngine()
    backend = make_backend(None if state == "starting" else engine)
    backend.status = "starting: loading stages"
    engine.ready = state != "silent"
    if state == "draining":
        backend.begin_drain()

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, headers, body = await post(client, "/v1/completions", {"prompt": "x"})
        assert (status, headers["Retry-After"], body["error"]["code"]) == (503, "5", "pipeline_unavailable")
        if state == "starting":
            assert body["error"]["message"] == "starting: loading stages"

    run_client(backend, scenario)
    assert engine.submitted == []


def test_queue_full_is_429_with_retry_after() -> None:
    engine = FakeEngine()
    engine.refuse = QueueFull("256 requests are already waiting")

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, headers, body = await post(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        assert (status, headers["Retry-After"], body["error"]["code"]) == (429, "1", "queue_full")

    run_client(make_backend(engine), scenario)


def test_http_level_errors_are_openai_objects() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        response = await client.get("/v1/nothing")
        assert response.status == 404 and (await response.json())["error"]["code"] == "not_found"
        response = await client.get("/v1/completions")
        assert response.status == 405 and "POST" in response.headers["Allow"]
        response = await client.post("/v1/completions", data=b"x" * (http.MAX_BODY_BYTES + 1))
        body = await response.json()
        assert (response.status, body["error"]["code"]) == (413, "request_too_large")

    run_client(make_backend(FakeEngine()), scenario)


def test_bodies_are_decoded_as_their_content_encoding_says(caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine()
    body = b'{"prompt": "x", "max_tokens": 2}'

    async def scenario(client: TestClient[Any, Any]) -> None:
        async def status(data: bytes, encoding: str) -> tuple[int, str | None]:
            response = await client.post("/v1/completions", data=data, headers={"Content-Encoding": encoding})
            return response.status, (await response.json()).get("error", {}).get("code")

        for data, encoding in ((gzip.compress(body), "gzip"), (zlib.compress(body), "deflate"),
                               (zlib.compress(body)[2:-4], "deflate"), (gzip.compress(gzip.compress(body)), "gzip, gzip"),
                               (gzip.compress(body[:10]) + gzip.compress(body[10:]), "x-gzip"), (body, "identity")):
            assert await status(data, encoding) == (200, None), encoding  # raw deflate and gzip members too
        assert await status(b"not gzip", "gzip") == (400, None)
        assert await status(gzip.compress(body)[:-6], "gzip") == (400, None)  # its trailer (CRC, length) cut
        assert await status(gzip.compress(body)[:-8] + b"\xff" * 8, "gzip") == (400, None)  # a wrong CRC
        assert await status(zlib.compress(body)[2:40], "deflate") == (400, None)  # a stream that does not end
        assert await status(zlib.compress(body) + b"junk", "deflate") == (400, None)
        assert await status(body, "br") == (415, "unsupported_content_encoding")
        assert await status(gzip.compress(body), "gzip, zstd") == (415, "unsupported_content_encoding")
        bomb = gzip.compress(b" " * (4 * http.MAX_BODY_BYTES))  # 4 KiB that decode to 4 MiB
        assert await status(bomb, "gzip") == (413, "request_too_large")

    run_client(make_backend(engine), scenario)
    assert len(engine.submitted) == 6
    assert _warnings(caplog) == []


def test_an_error_naming_a_lone_surrogate_still_encodes() -> None:
    response = http.error_response(ApiError.invalid("a\ud800b", "unknown field"))  # raised UnicodeEncodeError before
    assert response.body is not None and json.loads(bytes(response.body))["error"]["param"] == "a\ud800b"


def test_decode_body_messages_name_the_coding() -> None:
    with pytest.raises(ApiError) as caught:
        http.decode_body(b"xx", "gzip")
    assert caught.value.message.startswith("the request body is not valid gzip data, as its Content-Encoding says")
    with pytest.raises(ApiError) as caught:
        http.decode_body(b"xx", "a\udcffb")  # a header byte that is not UTF-8, as aiohttp decodes it
    assert caught.value.status == 415 and "'a\\udcffb'" in caught.value.message
    assert http.decode_body(b"plain", None) == b"plain"


def test_malformed_http_that_aiohttp_answers_leaves_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), WAIT_S)
        writer.close()
        assert status_line == b"HTTP/1.0 400 Bad Request\r\n"  # aiohttp's own answer

    with caplog.at_level(logging.DEBUG, logger="skippy_zmq.gateway.aiohttp"):
        run_client(make_backend(FakeEngine()), scenario)
    mistakes = [record for record in caplog.records if record.name == "skippy_zmq.gateway.aiohttp"]
    assert mistakes and all(record.levelno == logging.DEBUG and record.exc_info is None for record in mistakes)
    assert "Error handling request" in mistakes[0].getMessage()
    assert _warnings(caplog) == []


def test_server_logger_keeps_other_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    logger = http.server_logger()
    assert http.server_logger() is logger and len(logger.filters) == 1
    try:
        raise RuntimeError("a bug")
    except RuntimeError:
        logger.exception("Unhandled exception")
    assert [(record.levelno, record.exc_info is not None) for record in caplog.records] == [(logging.ERROR, True)]


def test_a_body_that_does_not_arrive_is_a_408(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http, "BODY_TIMEOUT_S", 0.2)

    async def scenario(client: TestClient[Any, Any]) -> None:
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), WAIT_S)
        writer.close()
        assert status_line.startswith(b"HTTP/1.1 408 ")

    run_client(make_backend(FakeEngine()), scenario)


# --- any JSON, through the app -------------------------------------------------------------------


class LiveApp:
    """The app on an asyncio loop in a thread, for tests that send many requests from plain sockets."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        app = http.make_app(make_backend(FakeEngine(step_s=0.0005)), GatewayMetrics())
        self.server = TestServer(app)
        asyncio.run_coroutine_threadsafe(self.server.start_server(**http.server_options()), self.loop).result(10)

    def post(self, path: str, data: bytes) -> tuple[int, bytes]:
        connection = HTTPConnection(self.server.host, self.server.port, timeout=WAIT_S)
        try:
            connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def live_app() -> Iterator[LiveApp]:
    app = LiveApp()
    try:
        yield app
    finally:
        app.close()


_KEYS = [*FIELDS, "content", "role", "type", "text", "include_usage"]
_OPTIONS = {"max_tokens": st.integers(0, 8) | HUGE_INTEGERS, "stream": st.booleans(), "stop": HOSTILE_TEXT}
_BODIES = (
    st.fixed_dictionaries({"prompt": HOSTILE_TEXT}, optional=_OPTIONS).map(lambda body: json_text(body).encode())
    | st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "hi"}])}, optional=_OPTIONS).map(
        lambda body: json_text(body).encode())
    | hostile_json(_KEYS, {"prompt": HOSTILE_TEXT}, extra=1)
    | hostile_json(_KEYS, {"messages": st.just([{"role": "user", "content": "hi"}])}, extra=1)
    | hostile_json(_KEYS, {"messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": HOSTILE_TEXT,
                                                                        }), min_size=1, max_size=2)}, extra=1)
    | hostile_json(_KEYS)
)


@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), data=_BODIES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_hostile_body_gets_a_200_or_a_4xx_never_a_500(
    live_app: LiveApp, caplog: pytest.LogCaptureFixture, path: str, data: bytes,
) -> None:
    status, body = live_app.post(path, data)
    event(str(status))
    text = body.decode("utf-8")  # strict: the answer is valid text
    assert status == 200 or 400 <= status < 500, (status, text[:300])
    if status != 200:
        assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}
    elif text.startswith("data: "):
        assert sse_events(text)
    else:
        assert json.loads(text)["object"] in ("text_completion", "chat.completion")
    assert _warnings(caplog) == []


# --- cancellation and deadlines ------------------------------------------------------------------


def test_stream_client_that_disconnects_is_cancelled() -> None:
    engine = FakeEngine(step_s=0.02)

    async def scenario(client: TestClient[Any, Any]) -> None:
        response = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 40, "stream": True})
        await response.content.readuntil(b"\n\n")
        response.close()
        await wait_until(lambda: len(engine.cancelled) == 1)

    run_client(make_backend(engine), scenario)
    assert len(engine.submitted) == 1


def test_whole_request_client_that_disconnects_is_cancelled() -> None:
    engine = FakeEngine()
    engine.hang = True

    async def scenario(client: TestClient[Any, Any]) -> None:
        with pytest.raises(asyncio.TimeoutError):
            await client.post("/v1/completions", json={"prompt": "x"}, timeout=aiohttp.ClientTimeout(total=0.3))
        await wait_until(lambda: len(engine.cancelled) == 1)
        text = await (await client.get("/metrics")).text()
        assert 'skippy_gateway_requests_total{route="/v1/completions",status="499"} 1.0' in text

    run_client(make_backend(engine), scenario)


def test_gateway_deadline_is_a_504_and_cancels(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine()
    engine.hang, engine.request_timeout_s = True, 0.2
    monkeypatch.setattr(http, "DEADLINE_GRACE_S", 0.0)

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, body = await post(client, "/v1/completions", {"prompt": "x"})
        assert (status, body["error"]["code"]) == (504, "request_timeout")
        response = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
        events = sse_events(await response.text())
        assert events[-1]["error"]["code"] == "request_timeout"

    run_client(make_backend(engine), scenario)
    assert len(engine.cancelled) == 2


def test_events_after_the_loop_closed_are_dropped() -> None:
    engine = FakeEngine()
    engine.hang = True
    runs: list[http.Run] = []

    async def main() -> None:
        runs.append(http.Run(engine, GenerationRequest("p", prompt_ids=(1,)), 0.0))

    asyncio.run(main())
    runs[0]._on_event(Delta("x", (1,)))  # the engine thread after shutdown: must not raise
    engine.cancel(runs[0].ticket)


# --- metrics -------------------------------------------------------------------------------------


def test_metrics() -> None:
    metrics = GatewayMetrics()

    async def scenario(client: TestClient[Any, Any]) -> None:
        await post(client, "/v1/completions", {"prompt": "x", "max_tokens": 4})
        await post(client, "/v1/completions", {"prompt": "x", "n": 3})  # more than the 2 lanes: a 400
        response = await client.get("/metrics")
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
        assert 'skippy_gateway_requests_total{route="/v1/completions",status="200"} 1.0' in text
        assert 'skippy_gateway_requests_total{route="/v1/completions",status="400"} 1.0' in text
        assert "skippy_gateway_queue_depth 3.0" in text
        assert "skippy_gateway_running_sessions 1.0" in text
        assert "skippy_gateway_time_to_first_token_seconds_count 1.0" in text
        assert "skippy_gateway_inter_token_seconds_count 3.0" in text
        assert "skippy_gateway_request_seconds_count 1.0" in text
        assert "skippy_gateway_prompt_tokens_total 2.0" in text
        assert "skippy_gateway_completion_tokens_total 4.0" in text

    run_client(make_backend(FakeEngine()), scenario, metrics)


def test_metrics_carry_llama_servers_names_and_header() -> None:
    """The llamacpp:* lines as llama-server's tests parse them: a TYPE and HELP line each, no labels."""
    from skippy_zmq.gateway.metrics import _LLAMA_METRICS

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, answer = await post(client, "/completion", {"prompt": "hello", "n_predict": 4})
        assert status == 200
        assert (await post(client, "/v1/embeddings", {"input": ["ab", "cd"]}))[0] == 200
        response = await client.get("/metrics")
        assert abs(int(response.headers["Process-Start-Time-Unix"]) - time.time()) < 60
        text = await response.text()
        types = dict(line.split(" ", 3)[2:] for line in text.splitlines() if line.startswith("# TYPE llamacpp:"))
        values = {name: float(value) for name, value in
                  (line.split(" ", 1) for line in text.splitlines() if line.startswith("llamacpp:"))}
        assert set(values) == set(types) == {f"llamacpp:{name}" for name, _, _ in _LLAMA_METRICS}
        assert all(f"# HELP {name} " in text for name in values)
        assert types["llamacpp:prompt_tokens_total"] == "counter" and types["llamacpp:requests_processing"] == "gauge"
        embedded = len(TOKENIZER.encode("ab")) + len(TOKENIZER.encode("cd"))
        assert values["llamacpp:prompt_tokens_total"] == answer["timings"]["prompt_n"] + embedded
        assert values["llamacpp:tokens_predicted_total"] == answer["timings"]["predicted_n"] == 4
        assert values["llamacpp:n_decode_total"] == 1 + 3 + 2  # a prompt, 3 tokens after the first, 2 inputs
        assert values["llamacpp:spec_decode_num_drafts_total"] == 0

    run_client(make_backend(FakeEngine()), scenario)


def test_the_speculation_counters_count_the_drafts_and_the_steps_they_saved() -> None:
    # 9 tokens: the first from the prompt's step, 3 of the 8 after it brought by accepted drafts (2 verifications
    # carried 5 draft tokens), so 5 decode steps after the prompt's
    from skippy_zmq.gateway.metrics import LlamaCounters

    counters = LlamaCounters()
    counters.ended(GenerationResult(prompt="p", prompt_ids=[1, 2], tokens=list(range(9)), started_s=1.0,
                                    first_token_s=1.5, finished_s=2.0, drafts=5, drafts_accepted=3, verifications=2))
    values = {line.split()[0]: float(line.split()[1]) for line in counters.render(0, 0).splitlines()
              if line.startswith("llamacpp:")}
    assert values["llamacpp:spec_decode_num_draft_tokens_total"] == 5
    assert values["llamacpp:spec_decode_num_accepted_tokens_total"] == 3
    assert values["llamacpp:spec_decode_num_drafts_total"] == 2
    assert values["llamacpp:n_decode_total"] == 1 + 5


def test_the_throughput_gauges_average_the_requests_since_the_last_scrape() -> None:
    from skippy_zmq.gateway.metrics import LlamaCounters

    def value(text: str, name: str) -> float:
        (line,) = [line for line in text.splitlines() if line.startswith(f"llamacpp:{name} ")]
        return float(line.split()[1])

    counters = LlamaCounters()
    result = GenerationResult(prompt="p", prompt_ids=[1, 2, 3, 4], tokens=[5, 6, 7, 8, 9], started_s=10.0,
                              first_token_s=10.5, finished_s=11.5)
    counters.ended(result)
    first = counters.render(0, 0)
    assert (value(first, "prompt_tokens_seconds"), value(first, "predicted_tokens_seconds")) == (8.0, 5.0)
    second = counters.render(0, 0)  # nothing ended since: an empty window, as llama-server's buckets
    assert (value(second, "prompt_tokens_seconds"), value(second, "predicted_tokens_seconds")) == (0.0, 0.0)
    assert value(second, "tokens_predicted_total") == 5 and value(second, "prompt_seconds_total") == 0.5


def test_metrics_and_health_say_what_the_driver_saw_of_its_stages() -> None:
    """A stage found down, back as a new process, its sessions replayed; then stage 0 silent and its
    handshake failing (a StageWatch on a scripted clock): /metrics counts each per stage and host,
    /health names the stage still down and what to check."""
    liveness = Liveness(("stage 0", "stage 1"), 15.0)
    places = (StagePlace(0, "stage-0", "tcp://10.0.0.1:5710", "keys/public/stage-0.key"),
              StagePlace(1, "stage-1", "tcp://10.0.0.2:5711", "keys/public/stage-1.key"))
    watch = StageWatch(places, liveness, recovery_timeout_s=60.0, recovery_silence_s=15.0, send_timeout_s=15.0)
    for stage in (0, 1):
        liveness.heard(stage, 0.0, 10 + stage)
    watch.observe(0.0, RecoveryView())
    liveness.heard(0, 4.0, 10)
    watch.observe(4.0, RecoveryView(running=2))  # stage 1 silent for 4 s: down
    liveness.heard(1, 9.0, 99)
    watch.restarted(1, 9.0)  # a new process
    watch.replayed([1], 2, 9.0)
    watch.link(0, LinkTrouble.KEY, 9.5)
    liveness.heard(1, 14.0, 99)
    watch.observe(14.0, RecoveryView())  # stage 0 silent for 10 s: down, and still down
    engine = FakeEngine()
    engine.ready, engine.silent, engine.stages = False, ('stage 0 "stage-0" (layers 0..2)',), watch.statuses()

    async def scenario(client: TestClient[Any, Any]) -> None:
        text = await (await client.get("/metrics")).text()
        samples = {(s.name, s.labels.get("stage"), s.labels.get("cause")): (s.value, s.labels)
                   for family in text_string_to_metric_families(text) for s in family.samples}
        value = {key: got for key, (got, _) in samples.items()}
        assert samples[("skippy_gateway_stage_down_total", "stage-1", None)][1] == {
            "stage": "stage-1", "index": "1", "host": "10.0.0.2"}
        assert value[("skippy_gateway_stage_up", "stage-0", None)] == 0.0
        assert value[("skippy_gateway_stage_up", "stage-1", None)] == 1.0
        assert value[("skippy_gateway_stage_down_total", "stage-1", None)] == 1.0
        assert value[("skippy_gateway_stage_down_seconds_total", "stage-1", None)] == pytest.approx(5.0)
        assert value[("skippy_gateway_stage_down_seconds_total", "stage-0", None)] > 0.0  # under way
        assert value[("skippy_gateway_stage_restarts_total", "stage-1", None)] == 1.0
        assert value[("skippy_gateway_stage_sessions_replayed_total", "stage-1", None)] == 2.0
        assert value[("skippy_gateway_stage_sessions_given_up_total", "stage-1", None)] == 0.0
        assert value[("skippy_gateway_stage_handshakes_failed_total", "stage-0", "key")] == 1.0
        response = await client.get("/health")
        body = await response.json()
        assert (response.status, body["status"]) == (503, "waiting")
        assert [(s["id"], s["host"], s["state"]) for s in body["stages"]] == [
            ("stage-0", "10.0.0.1", "down"), ("stage-1", "10.0.0.2", "up")]
        assert body["stages"][0]["detail"] == ("down (no heartbeat for 10.0 s): the stage hung up on the CURVE "
                                               "handshake: most likely its public key is not keys/public/stage-0.key "
                                               "(the stage runs another key pair, or the file is stale)")
        assert 'stage 0 "stage-0" down (no heartbeat for 10.0 s)' in body["message"]

    run_client(make_backend(engine), scenario)


def metric(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


# --- API key ---------------------------------------------------------------------------------------

KEY = "sk-test-0123456789"


def keyed_client(client: TestClient[Any, Any], key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0, timeout=WAIT_S)


@pytest.mark.parametrize(("authorization", "code", "challenge"), [
    (None, None, "Bearer"),
    ("", None, "Bearer"),
    ("Bearer", None, "Bearer"),
    ("Bearer   ", None, "Bearer"),
    (f"Basic {KEY}", None, "Bearer"),
    (KEY, None, "Bearer"),
    ("Bearer sk-wrong", "invalid_api_key", 'Bearer error="invalid_token"'),
    (f"Bearer {KEY}x", "invalid_api_key", 'Bearer error="invalid_token"'),
    (f"Bearer {KEY[:-1]}", "invalid_api_key", 'Bearer error="invalid_token"'),
    ("Bearer sk-t\u00e9st", "invalid_api_key", 'Bearer error="invalid_token"'),
])
def test_every_v1_route_needs_the_key(authorization: str | None, code: str | None, challenge: str) -> None:
    engine = FakeEngine()
    metrics = GatewayMetrics()
    headers = {} if authorization is None else {"Authorization": authorization}
    requests = [("GET", "/v1/models"), ("GET", "/v1/models/tiny-model"), ("POST", "/v1/completions"),
                ("POST", "/v1/chat/completions"), ("GET", "/v1/nothing"), ("GET", "/v1/completions"),
                ("GET", "/nothing"), ("GET", "/stages")]  # "/", the web page, holds no data: tests/gateway/test_web_page.py

    async def scenario(client: TestClient[Any, Any]) -> None:
        for method, path in requests:
            response = await client.request(method, path, json={"prompt": "x"}, headers=headers)
            body = await response.json()
            assert (response.status, response.headers["WWW-Authenticate"]) == (401, challenge), path
            assert body["error"]["type"] == "authentication_error"
            assert (body["error"]["code"], body["error"]["param"]) == (code, None)
            assert KEY not in body["error"]["message"]

    run_client(make_backend(engine), scenario, metrics, api_key=KEY)
    assert engine.submitted == []
    assert metric(metrics, "skippy_gateway_requests_total", route="/v1/completions", status="401") == 1
    assert metric(metrics, "skippy_gateway_requests_total", route="unmatched", status="401") == 3


def test_health_and_metrics_stay_open_and_the_key_opens_the_rest() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        assert (await client.get("/health")).status == 200
        assert (await client.get("/metrics")).status == 200
        for scheme in ("Bearer", "bearer", "BEARER"):
            response = await client.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
            assert response.status == 200
        response = await client.get("/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
        assert response.status == 404  # with the key, the usual answers
        # X-Api-Key (Anthropic's clients; llama-server accepts it) when there is no Authorization header
        assert (await client.get("/v1/models", headers={"X-Api-Key": KEY})).status == 200
        assert (await client.get("/v1/models", headers={"X-Api-Key": "sk-wrong"})).status == 401
        wrong_bearer = {"X-Api-Key": KEY, "Authorization": "Bearer sk-wrong"}  # Authorization, when sent, decides
        assert (await client.get("/v1/models", headers=wrong_bearer)).status == 401

    run_client(make_backend(FakeEngine()), scenario, api_key=KEY)


def test_the_key_with_the_openai_client() -> None:
    engine = FakeEngine()
    metrics = GatewayMetrics()

    async def scenario(client: TestClient[Any, Any]) -> None:
        out = await keyed_client(client).completions.create(model="tiny-model", prompt="hi", max_tokens=2)
        assert out.choices[0].text == " w0 w1"
        stream = await keyed_client(client).chat.completions.create(
            model="tiny-model", messages=[{"role": "user", "content": "x"}], max_tokens=2, stream=True)
        assert "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]) == " w0 w1"
        with pytest.raises(openai.AuthenticationError) as wrong:
            await keyed_client(client, "sk-wrong").completions.create(model="tiny-model", prompt="hi")
        assert (wrong.value.status_code, wrong.value.code, wrong.value.type) == (401, "invalid_api_key",
                                                                                 "authentication_error")
        with pytest.raises(openai.AuthenticationError) as missing:
            await keyed_client(client).models.list(extra_headers={"Authorization": openai.Omit()})
        assert (missing.value.status_code, missing.value.code) == (401, None)
        assert "Authorization" in missing.value.message

    run_client(make_backend(engine), scenario, metrics, api_key=KEY)
    assert len(engine.submitted) == 2
    assert metric(metrics, "skippy_gateway_requests_total", route="/v1/completions", status="401") == 1
    assert metric(metrics, "skippy_gateway_requests_total", route="/v1/models", status="401") == 1


def test_the_key_is_checked_before_the_body_is_read() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        response = await client.post("/v1/completions", data=b"x" * (http.MAX_BODY_BYTES + 1))
        assert response.status == 401  # not 413: nothing was read

    run_client(make_backend(FakeEngine()), scenario, api_key=KEY)


def test_check_api_key_compares_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[tuple[bytes, bytes]] = []
    monkeypatch.setattr(http.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or a == b)
    http.check_api_key(f"Bearer {KEY}", KEY.encode())
    with pytest.raises(ApiError):
        http.check_api_key("Bearer nope", KEY.encode())
    assert compared == [(KEY.encode(), KEY.encode()), (b"nope", KEY.encode())]


# --- per-client cap ----------------------------------------------------------------------------------


def test_limiter_caps_each_client_and_releases_once() -> None:
    refused: list[int] = []
    limiter = ClientLimiter(2, on_refused=lambda: refused.append(1))
    first, second = limiter.acquire("a"), limiter.acquire("a")
    other = limiter.acquire("b")  # the cap is per client
    with pytest.raises(ApiError) as capped:
        limiter.acquire("a")
    error = capped.value
    assert (error.status, error.type, error.code, error.retry_after_s) == (429, "rate_limit_error",
                                                                           "too_many_requests", 1)
    assert "cap of 2 requests in flight" in error.message and "--max-client-requests" in error.message
    assert refused == [1]
    first.release()
    first.release()  # idempotent: a second end path changes nothing
    assert limiter.in_flight("a") == 1
    with limiter.acquire("a"):
        assert limiter.in_flight("a") == 2
    assert limiter.in_flight("a") == 1
    second.release()
    other.release()
    assert (limiter.in_flight("a"), len(limiter)) == (0, 0)  # clients with nothing in flight are forgotten


@pytest.mark.parametrize("cap", [None, 0])
def test_limiter_without_a_cap(cap: int | None) -> None:
    limiter = ClientLimiter(cap)
    slots = [limiter.acquire("a") for _ in range(1000)]
    assert limiter.in_flight("a") == 1000
    for slot in slots:
        slot.release()
    assert len(limiter) == 0


def test_http_cap_per_peer_released_on_every_end() -> None:
    engine = FakeEngine(step_s=0.01)
    engine.hang = True
    metrics = GatewayMetrics()

    async def scenario(client: TestClient[Any, Any]) -> None:
        held = [await client.post("/v1/completions", json={"prompt": "x", "stream": True}) for _ in range(2)]
        await wait_until(lambda: len(engine.submitted) == 2)
        status, headers, body = await post(client, "/v1/completions", {"prompt": "x"})
        assert (status, headers["Retry-After"], body["error"]["code"]) == (429, "1", "too_many_requests")
        assert "cap of 2 requests in flight" in body["error"]["message"]
        held[0].close()  # a disconnect frees its slot
        await wait_until(lambda: len(engine.cancelled) == 1)
        engine.hang = False
        assert (await post(client, "/v1/completions", {"prompt": "x", "max_tokens": 2}))[0] == 200  # finished
        for bad in ({"prompt": "x", "n": 3}, {"prompt": "x", "top_p": 7}):  # errors free theirs
            assert (await post(client, "/v1/completions", bad))[0] in (400, 404)
        engine.refuse = QueueFull("full")
        assert (await post(client, "/v1/completions", {"prompt": "x"}))[0] == 429
        engine.refuse, engine.failure = None, RemoteStageError("boom")
        assert (await post(client, "/v1/completions", {"prompt": "x"}))[0] == 500
        engine.failure = None
        assert (await post(client, "/v1/completions", {"prompt": "x", "max_tokens": 2}))[0] == 200
        held[1].close()

    run_client(make_backend(engine), scenario, metrics, max_client_requests=2)
    assert metric(metrics, "skippy_gateway_client_cap_refused_total", api="http") == 1
    assert metric(metrics, "skippy_gateway_requests_total", route="/v1/completions", status="429") == 2


def test_http_cap_counts_a_deadline_and_a_slow_body(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine()
    engine.hang, engine.request_timeout_s = True, 0.1
    monkeypatch.setattr(http, "DEADLINE_GRACE_S", 0.0)
    monkeypatch.setattr(http, "BODY_TIMEOUT_S", 0.2)

    async def scenario(client: TestClient[Any, Any]) -> None:
        assert (await post(client, "/v1/completions", {"prompt": "x"}))[0] == 504
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        assert (await asyncio.wait_for(reader.readline(), WAIT_S)).startswith(b"HTTP/1.1 408 ")
        writer.close()
        engine.hang = False
        assert (await post(client, "/v1/completions", {"prompt": "x", "max_tokens": 1}))[0] == 200

    run_client(make_backend(engine), scenario, max_client_requests=1)


def test_text_too_long_for_any_tokenization_is_refused_without_tokenizing(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = FakeEngine(ctx_size=64)
    calls: list[str] = []
    monkeypatch.setattr(TOKENIZER, "encode", lambda text, **_: calls.append(text) or [1])

    def rendering(messages: Sequence[Mapping[str, Any]], **_: Any) -> list[int]:
        calls.append("chat")
        return [1]

    serving = AttachedEngine(engine, TOKENIZER, rendering)  # type: ignore[arg-type]
    longest = TOKENIZER.max_piece_chars
    huge = "x" * (64 * longest)  # at least 64 tokens (+ BOS) whatever it tokenizes to: no room
    for endpoint, body, param in (
        (Endpoint.COMPLETIONS, {"prompt": huge}, "prompt"),
        (Endpoint.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": huge}]}]}, "messages"),
    ):
        with pytest.raises(ApiError) as refused:
            serving.prepare(CompletionParams.from_body(endpoint, body))
        assert (refused.value.code, refused.value.param) == ("context_length_exceeded", param)
        assert "characters has at least" in refused.value.message
    assert calls == []
    serving.prepare(CompletionParams.from_body(Endpoint.COMPLETIONS, {"prompt": "x" * 10}))
    assert calls == ["x" * 10]  # a short prompt is tokenized as before


def test_a_stage_without_a_free_lane_makes_health_say_why_while_requests_still_queue() -> None:
    engine = FakeEngine()  # every stage heartbeats, but stage 0 lately refused a session for lack of a lane
    engine.starved = ('stage 0 "stage-0" (layers 0..2)',)

    async def scenario(client: TestClient[Any, Any]) -> None:
        response = await client.get("/health")
        body = await response.json()
        assert (response.status, body["status"]) == (503, "waiting")
        assert body["message"].startswith('stage 0 "stage-0" (layers 0..2) has no free lane')
        assert "requests stay queued" in body["message"]
        status, _, out = await post(client, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 200 and out["choices"][0]["text"] == " w0 w1"  # accepted, not a 503 or a 500

    run_client(make_backend(engine), scenario)


def test_health_names_each_emulated_link_and_says_nothing_of_links_otherwise() -> None:
    engine = FakeEngine()
    links = ({"stage": "stage-0", "to": "stage-1", "link": "delay=10ms"},
             {"stage": "stage-1", "to": "driver", "link": "delay=10ms"})
    emulated = GatewayState("/models/tiny-model.gguf")
    emulated.attach(AttachedEngine(engine, TOKENIZER, links=links))  # type: ignore[arg-type]
    bodies: list[dict[str, Any]] = []

    async def scenario(client: TestClient[Any, Any]) -> None:
        response = await client.get("/health")
        assert response.status == 200
        bodies.append(await response.json())

    run_client(emulated, scenario)
    run_client(make_backend(engine), scenario)
    assert bodies[0]["emulated_links"] == list(links) and bodies[0]["status"] == "ok"
    assert "emulated_links" not in bodies[1]


# --- issue 18: logprobs, n choices and embeddings through the openai client ----------------------


def test_completion_logprobs_with_the_openai_client() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        answer = await openai_client(client).completions.create(model="tiny-model", prompt="hi", max_tokens=3,
                                                                logprobs=2)
        logprobs = answer.choices[0].logprobs
        assert logprobs is not None and logprobs.top_logprobs is not None
        # ids 10, 11, 12 are the byte tokens 0x06..0x08: their pieces are those bytes
        assert logprobs.tokens == ["\x06", "\x07", "\x08"]
        assert logprobs.token_logprobs == [-0.5, -1.0, -1.5]
        assert logprobs.text_offset == [0, 1, 2]
        assert [len(top) for top in logprobs.top_logprobs] == [3, 3, 3]  # 2 alternatives and the sampled token
        assert engine.submitted[-1].request.logprobs == 2

    run_client(make_backend(engine), scenario)


def test_chat_logprobs_whole_and_streamed_with_the_openai_client() -> None:
    engine = FakeEngine()
    messages: Any = [{"role": "user", "content": "hi"}]

    async def scenario(client: TestClient[Any, Any]) -> None:
        api = openai_client(client)
        whole = await api.chat.completions.create(model="tiny-model", messages=messages, max_tokens=4,
                                                  logprobs=True, top_logprobs=3)
        content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None
        assert [entry.logprob for entry in content] == [-0.5, -1.0, -1.5, -2.0]
        assert content[0].bytes == [0x06] and content[0].token == "\x06"
        assert [[alt.logprob for alt in entry.top_logprobs] for entry in content[:1]] == [[-0.01, -0.02, -0.03]]
        assert engine.submitted[-1].request.logprobs == 3
        stream = await api.chat.completions.create(model="tiny-model", messages=messages, max_tokens=4,
                                                   logprobs=True, stream=True)
        streamed = []
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:  # a chunk's logprobs are those of the tokens of its text
                    assert choice.logprobs is not None and choice.logprobs.content is not None
                    assert len(choice.logprobs.content) == 1
                if choice.logprobs is not None and choice.logprobs.content:
                    streamed += choice.logprobs.content
        assert [entry.logprob for entry in streamed] == [-0.5, -1.0, -1.5, -2.0]
        assert all(entry.top_logprobs == [] for entry in streamed)  # logprobs: true alone asks for none
        assert engine.submitted[-1].request.logprobs == 0
        plain = await api.chat.completions.create(model="tiny-model", messages=messages, max_tokens=2)
        assert plain.choices[0].logprobs is None and engine.submitted[-1].request.logprobs is None

    run_client(make_backend(engine), scenario)


def test_n_choices_whole_with_the_openai_client() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        api = openai_client(client)
        answer = await api.completions.create(model="tiny-model", prompt="hi", max_tokens=3, n=2, seed=11,
                                              logprobs=0)
        assert [(c.index, c.text, c.finish_reason) for c in answer.choices] == [
            (0, " w0 w1 w2", "length"), (1, " c1w0", "stop")]  # choice 1 ended with an EOS
        second = answer.choices[1].logprobs
        assert second is not None and second.tokens == ["\x06", "<eos>"]  # the EOS has its logprob
        assert answer.usage is not None
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (3, 5)  # prompt once, choices summed
        request = engine.submitted[-1].request
        assert (request.n, request.sampling.seed) == (2, 11)  # the scheduler adds the choice index
        chat = await api.chat.completions.create(model="tiny-model", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=2, n=2)
        assert [c.message.content for c in chat.choices] == [" w0 w1", ""]  # choice 1: only an EOS

    run_client(make_backend(engine), scenario)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_choices_streamed_equal_the_whole(endpoint: str) -> None:
    engine = FakeEngine()
    engine.max_sessions = 3

    async def scenario(client: TestClient[Any, Any]) -> None:
        api = openai_client(client)
        texts: dict[int, str] = {}
        reasons: dict[int, str | None] = {}
        usage = None
        if endpoint == "chat":
            chat_stream = await api.chat.completions.create(
                model="tiny-model", messages=[{"role": "user", "content": "x"}], max_tokens=3, n=3, stream=True,
                stream_options={"include_usage": True})
            async for chat_chunk in chat_stream:
                usage = chat_chunk.usage or usage
                assert len(chat_chunk.choices) <= 1  # one choice per chunk
                for chat_choice in chat_chunk.choices:
                    texts[chat_choice.index] = texts.get(chat_choice.index, "") + (chat_choice.delta.content or "")
                    reasons[chat_choice.index] = chat_choice.finish_reason or reasons.get(chat_choice.index)
        else:
            stream = await api.completions.create(model="tiny-model", prompt="x", max_tokens=3, n=3, stream=True,
                                                  stream_options={"include_usage": True})
            async for chunk in stream:
                usage = chunk.usage or usage
                assert len(chunk.choices) <= 1
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, "") + choice.text
                    reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
        assert texts == {0: " w0 w1 w2", 1: " c1w0", 2: ""}
        assert reasons == {0: "length", 1: "stop", 2: "stop"}
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (2, 3 + 2 + 1)

    run_client(make_backend(engine), scenario)


def test_more_choices_than_lanes_is_a_400_naming_n() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            await openai_client(client).completions.create(model="tiny-model", prompt="x", n=3)
        assert info.value.param == "n"
        assert "n 3 is more than the pipeline's 2 lanes" in str(info.value)
        assert engine.submitted == []

    run_client(make_backend(engine), scenario)


def test_penalties_bias_and_ignored_fields_reach_the_request() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        await openai_client(client).chat.completions.create(
            model="tiny-model", messages=[{"role": "user", "content": "x"}], max_tokens=1, presence_penalty=0.5,
            frequency_penalty=-0.25, logit_bias={"42": -100, "7": 3}, user="alice", store=True,
            extra_body={"cache_prompt": True, "timings_per_token": False})
        sampling = engine.submitted[-1].request.sampling
        assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.25)
        assert sampling.logit_bias == ((7, 3.0), (42, -100.0))

    run_client(make_backend(engine), scenario)


def test_embeddings_with_the_openai_client_base64_and_float() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        api = openai_client(client)
        # the openai client asks for base64 by default and decodes it to floats
        answer = await api.embeddings.create(model="tiny-model", input=["hi", "hello"])
        assert [item.index for item in answer.data] == [0, 1]
        for item, ids in zip(answer.data, (TOKENIZER.encode("hi"), TOKENIZER.encode("hello")), strict=True):
            assert item.embedding == fake_vector(ids).tolist()  # float32 values, exact
        assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (3 + 6, 3 + 6)
        assert answer.model == "tiny-model"
        floats = await api.embeddings.create(model="tiny-model", input=[[5, 6, 7]], encoding_format="float",
                                             dimensions=N_EMBD)
        assert floats.data[0].embedding == fake_vector([5, 6, 7]).tolist()
        assert len(engine.submitted) == 3
        assert {(t.request.embedding, t.request.max_tokens) for t in engine.submitted} == {(Pooling.MEAN, 0)}
        assert engine.submitted[-1].request.prompt_ids == (5, 6, 7)

    run_client(make_backend(engine), scenario)


def test_embeddings_raw_shape_and_base64_bytes() -> None:
    engine = FakeEngine()

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, body = await post(client, "/v1/embeddings", {"input": [1, 2], "encoding_format": "base64"})
        assert status == 200
        assert set(body) == {"object", "data", "model", "usage"} and body["object"] == "list"
        item = body["data"][0]
        assert (item["object"], item["index"]) == ("embedding", 0)
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, fake_vector([1, 2]))

    run_client(make_backend(engine), scenario)


def test_pooling_none_answers_per_token_rows_on_embeddings_and_a_400_on_the_openai_route() -> None:
    engine = FakeEngine()
    backend = GatewayState("/models/tiny-model.gguf")
    backend.attach(AttachedEngine(engine, TOKENIZER, render_chat, n_embd=N_EMBD,  # type: ignore[arg-type]
                                  pooling=Pooling.NONE))

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, body = await post(client, "/v1/embeddings", {"input": "hello"})
        assert status == 400 and "--pooling none" in body["error"]["message"] and not engine.submitted
        status, _, body = await post(client, "/embeddings", {"input": ["hi", [5, 6, 7]]})
        assert status == 200
        assert [item["index"] for item in body] == [0, 1]
        # the fake engine's vector for each input, as rows of N_EMBD floats
        assert body[1]["embedding"] == [fake_vector([5, 6, 7]).tolist()]
        assert {t.request.embedding for t in engine.submitted} == {Pooling.NONE}

    run_client(backend, scenario)
    wide = MAX_EMBEDDING_VALUES // 5  # a model this wide: 5 rows fill a reply
    check_per_token_size([[1] * 5, [2] * 3], wide)
    with pytest.raises(ApiError, match=r"input\[1\] has 6 tokens; with --pooling none an input may have at most 5"):
        check_per_token_size([[1] * 5, [2] * 6], wide)


def test_an_embedding_input_that_fails_fails_the_request_and_cancels_the_rest() -> None:
    engine = FakeEngine()
    engine.failure = RemoteStageError("stage-1 answered an error")

    async def scenario(client: TestClient[Any, Any]) -> None:
        status, _, body = await post(client, "/v1/embeddings", {"input": ["a", "b"]})
        assert (status, body["error"]["code"]) == (500, "internal_error")
        assert "stage-1" in body["error"]["message"]

    run_client(make_backend(engine), scenario)


def test_embeddings_wait_for_the_pipeline_like_generation() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        status, headers, body = await post(client, "/v1/embeddings", {"input": "x"})
        assert (status, headers.get("Retry-After"), body["error"]["code"]) == (503, "5", "pipeline_unavailable")

    run_client(make_backend(), scenario)
