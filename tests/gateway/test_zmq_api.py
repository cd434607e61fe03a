"""The ZeroMQ request API: socket-free parsing and client table, then the ROUTER over a fake engine.

The in-process tests run `ZmqRequestApi` on an asyncio loop in a thread, with real ZeroMQ
sockets on 127.0.0.1 and the fake engine of tests/gateway/fakes.py (the `Engine` API: submit /
cancel / events from another thread) playing this module's scripts. The slow test at the end goes
through a real `skippy-zmq serve --zmq-bind`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import zmq
import zmq.asyncio
import zmq.auth
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from skippy_zmq import Client
from skippy_zmq.driver.engine import Delta, Done, Failed
from skippy_zmq.driver.generation import GenerationRequest, GenerationResult
from skippy_zmq.errors import (
    ConfigError,
    EngineUnavailable,
    GatewayBusy,
    GatewayError,
    GatewayRequestError,
    GatewayTimeout,
    GatewayUnavailable,
    QueueFull,
    RemoteStageError,
    RequestError,
    RequestTimeout,
    SkippyError,
)
from skippy_zmq.gateway.embedding_api import EmbeddingParams
from skippy_zmq.gateway.metrics import GatewayMetrics
from skippy_zmq.gateway.openai_api import ApiError, CompletionParams, Endpoint
from skippy_zmq.gateway.state import AttachedEngine, ClientLimiter, GatewayState
from skippy_zmq.gateway.zmq_api import MAX_MSG_SIZE, RCV_HWM, ZmqRequestApi, client_key
from skippy_zmq.gateway.zmq_outbox import SendBudget
from skippy_zmq.gateway.zmq_requests import (
    Cancel,
    ClientTable,
    Detokenize,
    Embed,
    EmbeddingGather,
    FrameShape,
    Info,
    Ping,
    Refused,
    Submit,
    Tokenize,
    check_embedding_size,
    decode_message,
    delta_frame,
    embedding_frame_bytes,
    error_frame,
    final_frame,
    parse_command,
    read_command,
    readable_id,
    text_answer,
)
from skippy_zmq.tokens.logprobs import TokenLogprobs
from skippy_zmq.tokens.pooling import Pooling
from skippy_zmq.wire.request_api import (
    MAX_FRAME_BYTES,
    Choice,
    Embeddings,
    GatewayInfo,
    StreamDelta,
    TokenLogprob,
    Usage,
    encode_frame,
)
from tests.gateway.fakes import N_EMBD, FakeEngine, FakeTokenizer, Step, fake_vector
from tests.strategies import HOSTILE_TEXT, HUGE_INTEGERS, hostile_json, json_text

Frame = dict[str, Any]


@pytest.fixture(autouse=True)
def _package_records_reach_caplog(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve's log (tests of the server) stops the package's records at its logger; here they must reach caplog."""
    monkeypatch.setattr(logging.getLogger("skippy_zmq"), "propagate", True)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The package's and aiohttp's records at WARNING or above (not the leftovers of other tests' loops)."""
    return [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(("skippy_zmq", "aiohttp"))]

# --- parsing (socket-free) -------------------------------------------------------------------------


def _raw(obj: Any) -> list[bytes]:
    return [json.dumps(obj).encode()]


def _refusal(frames: list[bytes]) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse_command(decode_message(frames))
    return caught.value


@pytest.mark.parametrize(
    ("frames", "status", "param", "message"),
    [
        ([b"{}", b"{}"], 400, None, "one frame holding a JSON object; got 2 frames"),
        ([], 400, None, "got 0 frames"),
        ([b"x" * (MAX_FRAME_BYTES + 1)], 413, None, "exceeds the limit of 1048576 bytes"),
        ([b"\xff\xfe"], 400, None, "not UTF-8 JSON"),
        ([b"{'v': 1}"], 400, None, "not UTF-8 JSON"),
        ([b"[" * 100_000 + b"]" * 100_000], 400, None, "nests JSON too deeply"),
        (_raw([1, 2]), 400, None, "must hold a JSON object, not list"),
        (_raw({"type": "ping"}), 400, "v", "unsupported protocol version None; this gateway speaks 1"),
        (_raw({"v": 2, "type": "ping"}), 400, "v", "unsupported protocol version 2"),
        (_raw({"v": True, "type": "ping"}), 400, "v", "unsupported protocol version True"),
        (_raw({"v": 1}), 400, "type", "unknown type None"),
        (_raw({"v": 1, "type": "generate", "id": "a"}), 400, "type", "unknown type 'generate'"),
        (_raw({"v": 1, "type": "completion", "prompt": "x"}), 400, "id", "a completion request needs an id"),
        (_raw({"v": 1, "type": "completion", "id": 7, "prompt": "x"}), 400, "id", "id must be a string"),
        (_raw({"v": 1, "type": "chat", "id": "", "messages": []}), 400, "id", "1 to 128 characters"),
        (_raw({"v": 1, "type": "completion", "id": "x" * 129, "prompt": "x"}), 400, "id", "1 to 128"),
        (_raw({"v": 1, "type": "cancel"}), 400, "id", "a cancel needs the id"),
        (_raw({"v": 1, "type": "ping", "prompt": "x"}), 400, "prompt", "a ping message has only v, type, id and"),
        (_raw({"v": 1, "type": "info", "waiting": []}), 400, "waiting", "an info message has only v, type and id"),
        (_raw({"v": 1, "type": "ping", "waiting": "r1"}), 400, "waiting", "waiting must be a list of at most 256"),
        (_raw({"v": 1, "type": "ping", "waiting": ["r"] * 257}), 400, "waiting", "at most 256 request ids"),
        (_raw({"v": 1, "type": "ping", "waiting": ["ok", 3]}), 400, "waiting", "ids of 1 to 128 characters"),
        (_raw({"v": 1, "type": "completion", "id": "a"}), 400, "prompt", "prompt is required"),
        (_raw({"v": 1, "type": "completion", "id": "a", "prompt": "x", "n": 0}), 400, "n", None),
        (_raw({"v": 1, "type": "tokenize", "content": "x"}), 400, "id", "a tokenize request needs an id"),
        (_raw({"v": 1, "type": "tokenize", "id": "t"}), 400, "content", "content must be the string to tokenize"),
        (_raw({"v": 1, "type": "tokenize", "id": "t", "content": ["x"]}), 400, "content", "got ['x']"),
        (_raw({"v": 1, "type": "tokenize", "id": "t", "content": "x", "add_special": 1}), 400, "add_special",
         "add_special must be true or false, got 1"),
        (_raw({"v": 1, "type": "tokenize", "id": "t", "content": "x", "with_pieces": True}), 400, "with_pieces",
         "a tokenize message has only v, type, id and content and add_special"),
        (_raw({"v": 1, "type": "detokenize", "id": "d"}), 400, "tokens", "tokens must be a list of token ids"),
        (_raw({"v": 1, "type": "detokenize", "id": "d", "tokens": [1, -1]}), 400, "tokens", "tokens holds -1"),
        (_raw({"v": 1, "type": "detokenize", "id": "d", "tokens": [1, None]}), 400, "tokens", "tokens holds None"),
        (_raw({"v": 1, "type": "detokenize", "id": "d", "tokens": [True]}), 400, "tokens", "tokens holds True"),
        (_raw({"v": 1, "type": "detokenize", "id": "d", "tokens": [2**31]}), 400, "tokens", "[0, 2147483647]"),
        ([b'{"v":1,"type":"detokenize","id":"d","tokens":[' + b"9" * 5000 + b"]}"], 400, "tokens",
         "tokens holds an integer of 5000 digits"),
        (_raw({"v": 1, "type": "detokenize", "id": "d", "tokens": [], "content": "x"}), 400, "content",
         "a detokenize message has only v, type, id and tokens"),
        (_raw({"v": 1, "type": "generate", "id": "e", "input": "x"}), 400, "type", "expected completion, chat, embed, "
         "tokenize, detokenize, cancel, ping or info"),
        (_raw({"v": 1, "type": "embed", "input": "x"}), 400, "id", "an embed request needs an id"),
        (_raw({"v": 1, "type": "embed", "id": "e"}), 400, "input", "input is required"),
        (_raw({"v": 1, "type": "embed", "id": "e", "input": ["ok", {"a": 1}]}), 400, "input[1]",
         "input[1] must be a string or a list of token ids"),
        (_raw({"v": 1, "type": "embed", "id": "e", "input": ["ok", ""]}), 400, "input[1]", "empty string"),
        (_raw({"v": 1, "type": "embed", "id": "e", "input": [[1], [-1]]}), 400, "input[1]", "token ids are integers"),
        (_raw({"v": 1, "type": "embed", "id": "e", "input": "x", "encoding_format": "hex"}), 400, "encoding_format",
         'encoding_format must be "float" or "base64"'),
        (_raw({"v": 1, "type": "embed", "id": "e", "input": "x", "dimensions": 0}), 400, "dimensions", ">= 1"),
        (_raw({"v": 1, "type": "embed", "id": "e", "input": "x", "stream": True}), 400, "stream", "unknown field"),
        (_raw({"v": 1, "type": "completion", "id": "a", "prompt": "x", "bogus": 1}), 400, "bogus", "unknown field"),
        (_raw({"v": 1, "type": "chat", "id": "a", "prompt": "x"}), 400, "prompt", "unknown field"),
        (_raw({"v": 1, "type": "chat", "id": "a", "messages": []}), 400, "messages", None),
        (_raw({"v": 1, "type": "completion", "id": "a", "prompt": "x", "temperature": 3}), 400, "temperature", None),
        # invalid text and integers no field can carry (docs/PROTOCOL.md §8.3)
        ([b'{"v":1,"type":"completion","id":"a\\ud800b","prompt":"x"}'], 400, "id", "lone surrogate"),
        ([b'{"v":1,"type":"completion","id":"a","prompt":"a\\ud800b"}'], 400, "prompt", "lone surrogate"),
        ([b'{"v":1,"type":"ping","a\\ud800b":1}'], 400, "a\\ud800b", "the field name 'a\\ud800b' is not valid"),
        ([b'{"v":1,"type":"ping","waiting":["ok","\\udfff"]}'], 400, "waiting[1]", "lone surrogate"),
        ([b'{"v":1,"type":"chat","id":"a","messages":[{"role":"user","content":"\\ud800"}]}'], 400,
         "messages[0].content", "lone surrogate"),
        ([b'{"v":1,"type":"completion","id":"a","prompt":"x","max_tokens":' + b"9" * 5000 + b"}"], 400, "max_tokens",
         "got an integer of 5000 digits"),
        ([b'{"v":' + b"1" * 5000 + b',"type":"ping"}'], 400, "v", "unsupported protocol version an integer of 5000"),
        ([b'{"v":1,"type":"ping","id":' + b"1" * 5000 + b"}"], 400, "id", "got an integer of 5000 digits"),
    ],
)
def test_bad_messages_are_refused_with_the_field(
    frames: list[bytes], status: int, param: str | None, message: str | None
) -> None:
    error = _refusal(frames)
    assert (error.status, error.param) == (status, param)
    if message is not None:
        assert message in error.message


def test_commands_of_good_messages() -> None:
    submit = parse_command({"v": 1, "type": "completion", "id": "r1", "prompt": "Hi", "max_tokens": 3})
    assert isinstance(submit, Submit)
    assert submit.request_id == "r1"
    assert submit.params.endpoint is Endpoint.COMPLETIONS
    assert (submit.params.prompt, submit.params.max_tokens, submit.params.stream) == ("Hi", 3, True)
    quiet = parse_command({"v": 1, "type": "chat", "id": "r2", "messages": [{"role": "user", "content": "Hi"}],
                           "stream": False, "max_completion_tokens": 5})
    assert isinstance(quiet, Submit)
    assert (quiet.params.endpoint, quiet.params.stream, quiet.params.max_tokens) == (Endpoint.CHAT, False, 5)
    assert parse_command({"v": 1, "type": "completion", "id": "r", "prompt": "x", "stream": None}) == attrs.evolve(
        parse_command({"v": 1, "type": "completion", "id": "r", "prompt": "x"})
    )
    assert parse_command({"v": 1, "type": "cancel", "id": "r1"}) == Cancel("r1")
    embed = parse_command({"v": 1, "type": "embed", "id": "e1", "input": ["Hi", [5, 6]], "encoding_format": "base64",
                           "model": None, "user": "alice"})  # null is absent, user is ignored: the HTTP API's body
    assert embed == Embed("e1", EmbeddingParams(("Hi", (5, 6)), None, "base64"))
    assert parse_command({"v": 1, "type": "ping"}) == Ping()
    assert parse_command({"v": 1, "type": "ping", "waiting": ["a", "b"]}) == Ping(None, ("a", "b"))
    assert parse_command({"v": 1, "type": "info", "id": "q"}) == Info("q")
    assert parse_command({"v": 1, "type": "tokenize", "id": "t", "content": "Hi"}) == Tokenize("t", "Hi", False)
    assert parse_command({"v": 1, "type": "tokenize", "id": "t", "content": "", "add_special": True}) == Tokenize(
        "t", "", True)
    assert parse_command({"v": 1, "type": "tokenize", "id": "t", "content": "a", "add_special": None}) == Tokenize(
        "t", "a", False)
    assert parse_command({"v": 1, "type": "detokenize", "id": "d", "tokens": [0, 5]}) == Detokenize("d", (0, 5))


def test_a_refusal_for_invalid_text_echoes_the_id_only_when_the_id_is_text() -> None:
    elsewhere = read_command(1, b'{"v":1,"type":"completion","id":"r7","prompt":"a\\ud800"}')
    in_id = read_command(1, b'{"v":1,"type":"completion","id":"r\\ud800","prompt":"a"}')
    assert isinstance(elsewhere, Refused) and isinstance(in_id, Refused)
    assert (elsewhere.request_id, elsewhere.error.param) == ("r7", "prompt")
    assert (in_id.request_id, in_id.error.param) == (None, "id")
    for refusal in (elsewhere, in_id):
        json.loads(encode_frame(error_frame(refusal.request_id, refusal.error, refused=True)).decode("utf-8"))


_ZMQ_KEYS = ["v", "type", "id", "waiting", "prompt", "messages", "max_tokens", "stream", "content", "role",
             "tokens", "add_special", "n", "logprobs"]
_TYPES = st.sampled_from(["completion", "chat", "ping", "info", "cancel", "tokenize", "detokenize"])
_ENDS = {"final", "error", "tokens", "text"}  # the frames that end a request (docs/PROTOCOL.md §8.3)


def _zmq_documents() -> st.SearchStrategy[bytes]:
    request_id = st.text(min_size=1, max_size=4)
    completion = {"v": st.just(1), "type": st.just("completion"), "id": request_id, "prompt": HOSTILE_TEXT}
    submits = st.fixed_dictionaries(completion, optional={"max_tokens": st.integers(0, 8) | HUGE_INTEGERS,
                                                          "stream": st.booleans() | HOSTILE_TEXT})
    return (submits.map(lambda document: json_text(document).encode())
            | hostile_json(["max_tokens", "stream", "stop", "seed", "temperature"], completion, extra=1)
            | hostile_json(_ZMQ_KEYS, {"v": st.just(1), "type": _TYPES, "id": request_id})
            | hostile_json(_ZMQ_KEYS, {"v": st.just(1), "type": _TYPES}) | hostile_json(_ZMQ_KEYS))


@given(_zmq_documents())
@settings(max_examples=400, deadline=None)
def test_any_hostile_frame_is_a_command_or_a_4xx_refusal_that_can_be_sent(data: bytes) -> None:
    command = read_command(1, data)
    if isinstance(command, Refused):
        assert 400 <= command.error.status < 500
        frame = encode_frame(error_frame(command.request_id, command.error, refused=True))
        assert json.loads(frame.decode("utf-8"))["code"] == command.error.status  # strict UTF-8: valid text
    else:
        json.dumps(attrs.asdict(command), ensure_ascii=False, default=repr).encode("utf-8")


def test_a_frame_holding_a_lone_surrogate_is_sent_with_its_json_escape() -> None:
    data = encode_frame({"v": 1, "type": "completion", "id": "r", "prompt": "a\ud800b"})
    assert data == b'{"v":1,"type":"completion","id":"r","prompt":"a\\ud800b"}'  # valid UTF-8
    assert json.loads(data.decode("utf-8"))["prompt"] == "a\ud800b"  # the gateway reads it back, and refuses it


def test_readable_id_only_for_valid_ids() -> None:
    assert readable_id({"id": "abc"}) == "abc"
    assert readable_id({"id": 3}) is None
    assert readable_id({"id": ""}) is None
    assert readable_id({}) is None


def test_error_frame_shape() -> None:
    assert error_frame("r", ApiError.invalid("top_p", "top_p must be in [0, 1]")) == {
        "v": 1, "type": "error", "id": "r", "code": 400, "error": "invalid_request",
        "message": "top_p must be in [0, 1]", "param": "top_p",
    }
    assert error_frame("r", ApiError.invalid("id", "dup"), refused=True)["refused"] is True
    busy = error_frame(None, ApiError.from_exception(QueueFull("full")))
    assert (busy["code"], busy["error"], busy["retry_after_s"], busy["id"]) == (429, "queue_full", 1, None)
    assert error_frame("r", ApiError.from_exception(RemoteStageError("boom")))["error"] == "internal_error"


# --- client table (socket-free, injected times) -----------------------------------------------------


def test_table_refuses_duplicate_ids_and_caps_requests_per_client() -> None:
    table = ClientTable(silence_s=15.0, max_per_client=2)
    first = table.open(b"A", "r1", 0.0, stream=True)
    with pytest.raises(ApiError) as dup:
        table.open(b"A", "r1", 1.0, stream=True)
    assert (dup.value.status, dup.value.code, dup.value.param) == (409, "duplicate_id", "id")
    table.open(b"B", "r1", 1.0, stream=True)  # ids are per client
    table.open(b"A", "r2", 1.0, stream=False)
    with pytest.raises(ApiError) as capped:
        table.open(b"A", "r3", 1.0, stream=True)
    assert (capped.value.status, capped.value.code) == (429, "too_many_requests")
    assert len(table) == 3
    table.close(first)
    assert table.get(b"A", "r1") is None
    assert table.open(b"A", "r1", 2.0, stream=True) is not first  # an ended id may be reused


def test_table_holds_a_cap_slot_until_the_request_leaves_it() -> None:
    limiter = ClientLimiter(2)
    table = ClientTable(limiter=limiter)
    first = table.open(b"conn-1", "r1", 0.0, stream=True, client="key-A")
    table.open(b"conn-2", "r1", 0.0, stream=True, client="key-A")  # two connections, one client
    with pytest.raises(ApiError) as capped:
        table.open(b"conn-3", "r1", 0.0, stream=True, client="key-A")
    assert capped.value.code == "too_many_requests"
    with pytest.raises(ApiError) as duplicate:  # a duplicate id takes no slot
        table.open(b"conn-1", "r1", 0.0, stream=True, client="key-A")
    assert duplicate.value.code == "duplicate_id"
    table.close(first)
    table.close(first)
    assert limiter.in_flight("key-A") == 1
    table.open(b"conn-1", "r2", 0.0, stream=True, client="key-A")
    assert len(table.forget(b"conn-1")) == 1 and len(table.forget(b"conn-2")) == 1
    assert len(limiter) == 0


def test_client_key_is_the_routing_id() -> None:
    assert client_key(b"\x00\x8b", zmq.Frame(b"{}")) == "008b"


def test_table_expires_only_clients_silent_longer_than_the_limit() -> None:
    table = ClientTable(silence_s=15.0)
    table.open(b"A", "r1", 0.0, stream=True)
    table.open(b"B", "r1", 0.0, stream=True)
    table.heard(b"B", 10.0)
    assert table.silent(15.0) == []  # exactly the limit is not longer than it
    assert table.silent(15.5) == [b"A"]
    assert table.silent(25.5) == [b"A", b"B"]
    assert [entry.request_id for entry in table.forget(b"A")] == ["r1"]
    assert table.silent(100.0) == [b"B"]


def test_table_forgets_idle_clients() -> None:
    table = ClientTable(silence_s=1.0)
    table.heard(b"idle", 0.0)  # a ping from a client with nothing outstanding is not tracked
    entry = table.open(b"A", "r1", 0.0, stream=True)
    table.close(entry)
    table.close(entry)  # closing twice is harmless
    assert table.silent(100.0) == []
    assert table.identities() == []
    assert len(table) == 0


def test_table_reports_overdue_requests() -> None:
    table = ClientTable()
    entry = table.open(b"A", "r1", 0.0, stream=True)
    assert table.overdue(1e9) == []  # no deadline until the engine took it
    entry.deadline = 50.0
    assert table.overdue(50.0) == []
    assert table.overdue(50.1) == [entry]
    stale = table.forget(b"A")[0]
    assert not table.is_open(stale)


# --- the ROUTER over a fake engine ------------------------------------------------------------------


def _hello(_: GenerationRequest) -> list[Step]:
    return [("delta", "Hel", (72,)), ("delta", "lo", (108,)), ("done", "eos", "Hello", [72, 108, 1])]


def _choices(request: GenerationRequest) -> list[Step]:
    """Every choice `i` of the request streams "c<i>" then "!" (tokens 60 + i, 33), interleaved; odd
    choices stop for length."""
    n = request.n
    steps: list[Step] = [("delta", f"c{i}", (60 + i,), i) for i in range(n)]
    steps += [("delta", "!", (33,), i) for i in reversed(range(n))]
    return [*steps, ("done_all", [("length" if i % 2 else "eos", f"c{i}!", [60 + i, 33]) for i in range(n)])]


def _embeds(request: GenerationRequest) -> list[Step]:
    """An embedding run: its vector at once (a generation is Hello)."""
    return [("embed",)] if request.embedding is not None else _hello(request)


class Harness:
    """`ZmqRequestApi` serving on an asyncio loop in a thread; raw DEALERs and Clients for the test."""

    def __init__(self, engine: FakeEngine | None, tokenizer: FakeTokenizer | None = None, *,
                 n_embd: int | None = N_EMBD, **options: Any) -> None:
        self.backend = GatewayState("models/tiny.gguf")
        if engine is not None:
            self.backend.attach(AttachedEngine(engine, tokenizer or FakeTokenizer(), FakeTokenizer.render_chat,
                                               n_embd=n_embd))
        self.metrics = GatewayMetrics()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.actx = zmq.asyncio.Context()
        self.ctx = zmq.Context()
        self.api: ZmqRequestApi = self.call(self._make(options))
        self.endpoint = self.api.endpoint
        self.served = asyncio.run_coroutine_threadsafe(self.api.run(), self.loop)
        self.sockets: list[zmq.Socket[bytes]] = []

    async def _make(self, options: dict[str, Any]) -> ZmqRequestApi:
        return ZmqRequestApi(self.backend, "tcp://127.0.0.1:*", metrics=self.metrics, context=self.actx, **options)

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(10)

    def client(self, **options: Any) -> Client:
        return Client(self.endpoint, context=self.ctx, **{"timeout_s": 5.0, **options})

    def dealer(self) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(self.endpoint)
        self.sockets.append(sock)
        return sock

    def status_count(self, status: int) -> float:
        value = self.metrics.registry.get_sample_value(
            "skippy_gateway_requests_total", {"route": "zmq", "status": str(status)})
        return 0.0 if value is None else float(value)

    def close(self) -> None:
        try:
            self.call(self.api.close())
            self.served.result(10)
        finally:
            for sock in self.sockets:
                sock.close(linger=0)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
            self.actx.term()
            self.ctx.term()


def _send(sock: zmq.Socket[bytes], frame: Frame | bytes) -> None:
    sock.send(frame if isinstance(frame, bytes) else json.dumps(frame).encode())


def _recv(sock: zmq.Socket[bytes], timeout_s: float = 5.0) -> Frame:
    assert sock.poll(int(timeout_s * 1000)), f"no frame within {timeout_s} s"
    frame: Frame = json.loads(sock.recv())
    return frame


def _until(sock: zmq.Socket[bytes], kinds: tuple[str, ...] = ("final", "error")) -> list[Frame]:
    frames = [_recv(sock)]
    while frames[-1]["type"] not in kinds:
        frames.append(_recv(sock))
    return frames


def _eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not true within {timeout_s} s"
        time.sleep(0.01)


@pytest.fixture
def harness() -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(engine: FakeEngine | None = None, tokenizer: FakeTokenizer | None = None, **options: Any) -> Harness:
        # options: n_embd (the attached model's width), then ZmqRequestApi's
        made.append(Harness(engine, tokenizer, **options))
        return made[-1]

    yield make
    for each in made:
        each.close()


def test_completion_streams_deltas_then_final(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(_hello)
    gate = harness(engine)
    sock = gate.dealer()
    _send(sock, {"v": 1, "type": "completion", "id": "r1", "prompt": "Hi", "max_tokens": 5, "temperature": 0})
    frames = _until(sock)
    assert frames == [
        {"v": 1, "type": "delta", "id": "r1", "text": "Hel", "token_ids": [72]},
        {"v": 1, "type": "delta", "id": "r1", "text": "lo", "token_ids": [108]},
        {"v": 1, "type": "final", "id": "r1", "finish_reason": "stop", "text": "Hello", "token_ids": [72, 108, 1],
         "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}, "model": "tiny"},
    ]
    request = engine.submitted[0].request
    assert (request.prompt_ids, request.max_tokens, request.sampling.temperature) == ((72, 105), 5, 0.0)
    assert gate.status_count(200) == 1
    registry = gate.metrics.registry
    assert registry.get_sample_value("skippy_gateway_time_to_first_token_seconds_count") == 1
    assert registry.get_sample_value("skippy_gateway_inter_token_seconds_count") == 1
    assert registry.get_sample_value("skippy_gateway_completion_tokens_total") == 3
    assert gate.api.outstanding == 0


def test_stream_false_sends_only_the_final(harness: Callable[..., Harness]) -> None:
    gate = harness(FakeEngine(_hello))
    sock = gate.dealer()
    _send(sock, {"v": 1, "type": "chat", "id": "c", "messages": [{"role": "user", "content": "Hi"}],
                 "stream": False})
    [final] = _until(sock)
    assert (final["type"], final["text"], final["usage"]["prompt_tokens"]) == ("final", "Hello", 3)


def test_client_complete_stream_and_chat(harness: Callable[..., Harness]) -> None:
    gate = harness(FakeEngine(_hello))
    with gate.client() as client:
        out = client.complete("Hi", max_tokens=5)
        assert (out.text, out.token_ids, out.finish_reason, out.usage.total_tokens) == ("Hello", (72, 108, 1), "stop", 5)
        assert [d.text for d in client.stream([5, 6])] == ["Hel", "lo", ""]
        assert client.chat([{"role": "user", "content": "Hi"}]).text == "Hello"
        deltas = list(client.chat_stream([{"role": "user", "content": "Hi"}], max_completion_tokens=4))
        assert deltas[-1] == StreamDelta("", (), "stop", deltas[-1].usage)
        assert client.info() == GatewayInfo("tiny", 64, True, (1,), MAX_FRAME_BYTES, 15.0)


@pytest.mark.parametrize(
    ("params", "error_class", "code", "kind"),
    [
        ({"top_p": 7}, GatewayRequestError, 400, "invalid_request"),
        ({"max_tokens": 100}, GatewayRequestError, 400, "context_length_exceeded"),
        ({"presence_penalty": 3}, GatewayRequestError, 400, "invalid_request"),
        ({"logit_bias": {"5": 101}}, GatewayRequestError, 400, "invalid_request"),
    ],
)
def test_invalid_requests_get_the_http_apis_answers(
    harness: Callable[..., Harness], params: Frame, error_class: type[GatewayError], code: int, kind: str
) -> None:
    engine = FakeEngine(_hello)
    gate = harness(engine)
    with gate.client() as client, pytest.raises(error_class) as caught:
        client.complete("Hi", **params)
    assert (caught.value.code, caught.value.kind) == (code, kind)
    assert engine.submitted == []
    assert gate.status_count(code) == 1


def test_chat_render_errors_are_400(harness: Callable[..., Harness]) -> None:
    gate = harness(FakeEngine(_hello))
    with gate.client() as client, pytest.raises(GatewayRequestError, match="not a role") as caught:
        client.chat([{"role": "robot", "content": "Hi"}])
    assert caught.value.param == "messages"


@pytest.mark.parametrize(
    ("refuse", "error_class", "builtin", "code"),
    [
        (QueueFull("2 requests wait"), GatewayBusy, QueueFull, 429),
        (EngineUnavailable("draining"), GatewayUnavailable, EngineUnavailable, 503),
        (RemoteStageError("stage 1 failed"), GatewayError, GatewayError, 500),
    ],
)
def test_engine_refusals_map_to_codes(
    harness: Callable[..., Harness], refuse: SkippyError, error_class: type[GatewayError],
    builtin: type[Exception], code: int,
) -> None:
    gate = harness(FakeEngine(_hello, refuse=refuse))
    with gate.client() as client, pytest.raises(error_class) as caught:
        client.complete("Hi")
    assert isinstance(caught.value, builtin)
    assert caught.value.code == code
    assert str(caught.value) == str(refuse)


@pytest.mark.parametrize(
    ("error", "error_class", "code"),
    [
        (RequestTimeout("deadline passed"), GatewayTimeout, 504),
        (RemoteStageError("stage 2 said no"), GatewayError, 500),
        (EngineUnavailable("drain timeout"), GatewayUnavailable, 503),
    ],
)
def test_failed_events_end_streams_with_typed_errors(
    harness: Callable[..., Harness], error: SkippyError, error_class: type[GatewayError], code: int
) -> None:
    gate = harness(FakeEngine(lambda _: [("delta", "a", (1,)), ("fail", error)]))
    with gate.client() as client:
        stream = client.stream("Hi")
        assert next(stream).text == "a"
        with pytest.raises(error_class) as caught:
            next(stream)
    assert caught.value.code == code


def test_not_ready_and_starting_are_503(harness: Callable[..., Harness]) -> None:
    starting = harness(None)
    with starting.client() as client:
        with pytest.raises(GatewayUnavailable) as caught:
            client.complete("Hi")
        assert caught.value.kind == "pipeline_unavailable"
        info = client.info()
        assert (info.ready, info.ctx_size) == (False, None)
    engine = FakeEngine(_hello)
    engine.ready = False
    with harness(engine).client() as client, pytest.raises(GatewayUnavailable):
        client.complete("Hi")


def test_bad_frames_are_answered_and_the_api_goes_on(harness: Callable[..., Harness]) -> None:
    gate = harness(FakeEngine(_hello))
    sock = gate.dealer()
    for bad in (b"not json", b"[]", b'{"v": 9, "type": "ping", "id": "p"}', b'{"v": 1, "type": "?", "id": "q"}'):
        _send(sock, bad)
    answers = [_recv(sock) for _ in range(4)]
    assert [(a["type"], a["code"], a["id"]) for a in answers] == [
        ("error", 400, None), ("error", 400, None), ("error", 400, "p"), ("error", 400, "q")]
    sock.send_multipart([b"two", b"frames"])
    assert _recv(sock)["message"].endswith("got 2 frames")
    _send(sock, b" " * (MAX_FRAME_BYTES + 10))
    too_big = _recv(sock)
    assert (too_big["code"], too_big["error"]) == (413, "too_large")
    _send(sock, {"v": 1, "type": "ping", "id": "p1"})
    assert _recv(sock) == {"v": 1, "type": "pong", "ready": True, "id": "p1"}
    assert gate.api.rejected == 6
    with gate.client() as client:
        assert client.complete("Hi").text == "Hello"


def _strict(data: bytes) -> Frame:
    frame: Frame = json.loads(data.decode("utf-8"))  # strict UTF-8: json.loads(bytes) would pass surrogates
    return frame


def test_invalid_text_and_huge_integers_are_refused_without_running_or_logging(
    harness: Callable[..., Harness], caplog: pytest.LogCaptureFixture,
) -> None:
    engine = FakeEngine(_hello)
    gate = harness(engine)
    sock = gate.dealer()
    hostile = [
        b'{"v":1,"type":"completion","id":"a\\ud800b","prompt":"x"}',  # ran and delivered nothing, before
        b'{"v":1,"type":"completion","id":"r2","prompt":"a\\ud800b"}',  # a 500, before
        b'{"v":1,"type":"ping","a\\ud800b":1}',  # no answer, before
        b'{"v":1,"type":"completion","id":"r4","prompt":"x","seed":' + b"7" * 4400 + b"}",
        b'{"v":1,"type":"chat","id":"r5","messages":[{"role":"user","content":"x","\\udc00":null}]}',
    ]
    for data in hostile:
        sock.send(data)
    answers = [_strict(sock.recv()) for _ in hostile if sock.poll(5000)]
    assert [(a["type"], a["code"], a["id"], a["param"], a["refused"]) for a in answers] == [
        ("error", 400, None, "id", True), ("error", 400, "r2", "prompt", True), ("error", 400, None, "a\\ud800b", True),
        ("error", 400, "r4", "seed", True), ("error", 400, "r5", "messages[0].\\udc00", True)]
    assert engine.submitted == [] and gate.status_count(400) == 5
    assert _warnings(caplog) == []
    with gate.client() as client:
        assert client.complete("Hi").text == "Hello"


def test_a_client_sending_a_lone_surrogate_gets_a_request_error(harness: Callable[..., Harness]) -> None:
    with harness(FakeEngine(_hello)).client() as client, pytest.raises(GatewayRequestError) as caught:
        client.complete("a\ud800b")
    assert (caught.value.code, caught.value.param) == (400, "prompt")


@given(data=_zmq_documents())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_hostile_frames_through_the_router_get_4xx_or_their_answers(
    shared_gateway: Harness, caplog: pytest.LogCaptureFixture, data: bytes,
) -> None:
    """One gateway serves every example; each gets a fresh DEALER and ends with an `info` whose
    answer comes after the example's own (the loop answers in order), or with its request's end."""
    command = read_command(1, data)
    event(type(command).__name__)
    sock = shared_gateway.ctx.socket(zmq.DEALER)
    try:
        sock.linger = 0
        sock.connect(shared_gateway.endpoint)
        sock.send(data)
        sock.send(encode_frame({"v": 1, "type": "info", "id": "\x00end!"}))  # longer than the examples' ids
        opened = isinstance(command, Submit | Tokenize | Detokenize)
        waiting = {("info", "\x00end!")} | ({("end", command.request_id)} if opened else set())
        frames: list[Frame] = []
        while waiting:
            assert sock.poll(5000), f"no answer to {data[:200]!r} within 5 s; got {frames}"
            frames.append(_strict(sock.recv()))
            kind = "end" if frames[-1]["type"] in _ENDS else frames[-1]["type"]
            waiting.discard((kind, frames[-1].get("id")))
    finally:
        sock.close(linger=0)
    assert [frame for frame in frames if frame.get("code", 0) >= 500] == []
    if isinstance(command, Refused):
        assert frames[0]["code"] == command.error.status and frames[0]["refused"] is True
    assert _warnings(caplog) == []


@pytest.fixture(scope="module")
def shared_gateway() -> Iterator[Harness]:
    gate = Harness(FakeEngine(_hello))
    try:
        yield gate
    finally:
        gate.close()


def test_a_ping_naming_a_request_the_gateway_does_not_hold_gets_a_404_for_it(
    harness: Callable[..., Harness],
) -> None:
    engine = FakeEngine(lambda _: [("sleep", 30.0)])
    gate = harness(engine)
    sock = gate.dealer()
    _send(sock, {"v": 1, "type": "completion", "id": "live", "prompt": "Hi"})
    _eventually(lambda: len(engine.submitted) == 1)
    _send(sock, {"v": 1, "type": "ping", "waiting": ["live", "ghost"]})
    assert _recv(sock) == {"v": 1, "type": "pong", "ready": True}
    ghost = _recv(sock)
    assert (ghost["id"], ghost["code"], ghost["error"], ghost["param"]) == ("ghost", 404, "unknown_request", "id")
    _send(sock, {"v": 1, "type": "cancel", "id": "live"})  # "live" was held: no error frame came for it
    assert _until(sock)[-1]["id"] == "live"


def test_a_duplicate_id_is_refused_and_the_first_goes_on(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(lambda _: [("sleep", 0.3), *_hello(_)])
    gate = harness(engine)
    sock = gate.dealer()
    request = {"v": 1, "type": "completion", "id": "same", "prompt": "Hi"}
    _send(sock, request)
    _send(sock, request)
    frames = _until(sock, ("final",))
    assert (frames[0]["type"], frames[0]["code"], frames[0]["error"]) == ("error", 409, "duplicate_id")
    assert frames[0]["refused"] is True  # it answers the second message; "same" runs on
    assert frames[-1]["text"] == "Hello" and "refused" not in frames[-1]
    assert len(engine.submitted) == 1
    _send(sock, request)  # ended: the id may be used again
    assert _until(sock)[-1]["type"] == "final"


def test_per_client_cap_hook(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(lambda _: [("sleep", 30.0)])
    gate = harness(engine, max_requests_per_client=1)
    sock = gate.dealer()
    _send(sock, {"v": 1, "type": "completion", "id": "a", "prompt": "Hi"})
    _send(sock, {"v": 1, "type": "completion", "id": "b", "prompt": "Hi"})
    refused = _recv(sock)
    assert (refused["id"], refused["code"], refused["error"]) == ("b", 429, "too_many_requests")
    other = gate.dealer()  # the cap is per client
    _send(other, {"v": 1, "type": "completion", "id": "a", "prompt": "Hi"})
    _send(other, {"v": 1, "type": "ping"})
    assert _recv(other)["type"] == "pong"
    _eventually(lambda: len(engine.submitted) == 2)


def test_cap_refusals_are_counted_and_every_end_frees_a_slot(harness: Callable[..., Harness]) -> None:
    def script(request: GenerationRequest) -> list[Step]:
        if request.prompt == "fail":
            return [("fail", RemoteStageError("boom"))]
        return [("sleep", 30.0)] if request.prompt == "hang" else _hello(request)

    engine = FakeEngine(script)
    gate = harness(engine, max_requests_per_client=1)
    sock = gate.dealer()

    def request(prompt: str, request_id: str = "a") -> None:
        _send(sock, {"v": 1, "type": "completion", "id": request_id, "prompt": prompt})

    request("hang")
    request("Hi", "b")
    refused = _recv(sock)
    assert (refused["id"], refused["code"], refused["error"], refused["retry_after_s"]) == (
        "b", 429, "too_many_requests", 1)
    assert "cap of 1 requests in flight" in refused["message"]
    _send(sock, {"v": 1, "type": "cancel", "id": "a"})  # cancelled: its slot is free again
    assert _recv(sock)["code"] == 499
    request("Hi")  # finished
    assert _until(sock)[-1]["type"] == "final"
    request("fail")  # failed
    assert _recv(sock)["code"] == 500
    request("Hi", "x" * 200)  # refused before it took a slot
    assert _recv(sock)["code"] == 400
    request("Hi")
    assert _until(sock)[-1]["type"] == "final"
    count = gate.metrics.registry.get_sample_value("skippy_gateway_client_cap_refused_total", {"api": "zmq"})
    assert count == 1


def test_a_silent_client_frees_its_slots(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(lambda request: [("sleep", 30.0)] if request.prompt == "hang" else _hello(request))
    gate = harness(engine, max_requests_per_client=1, client_silence_s=0.3)
    sock = gate.dealer()
    _send(sock, {"v": 1, "type": "completion", "id": "a", "prompt": "hang"})
    engine.wait_cancelled()
    _eventually(lambda: gate.api.outstanding == 0)
    _send(sock, {"v": 1, "type": "completion", "id": "a", "prompt": "Hi"})  # the same connection, a free slot
    assert _until(sock)[-1]["type"] == "final"


def test_a_message_of_many_frames_is_refused_unread(harness: Callable[..., Harness]) -> None:
    gate = harness(FakeEngine(_hello))
    sock = gate.dealer()
    sock.send_multipart([b"x" * 1000] * 2000)
    answer = _recv(sock)
    assert (answer["code"], answer["error"]) == (400, "invalid_request")
    assert answer["message"].endswith("got 2000 frames")
    with gate.client() as client:
        assert client.complete("Hi").text == "Hello"


def test_router_limits(harness: Callable[..., Harness]) -> None:
    gate = harness(FakeEngine(_hello))
    sock = gate.api._sock
    assert (sock.getsockopt(zmq.MAXMSGSIZE), sock.getsockopt(zmq.RCVHWM)) == (MAX_MSG_SIZE, RCV_HWM)
    dealer = gate.dealer()
    _send(dealer, b" " * (MAX_MSG_SIZE + 1))  # above ZMQ_MAXMSGSIZE: libzmq drops the connection
    assert not dealer.poll(300)
    with gate.client() as client:
        assert client.complete("Hi").text == "Hello"


def test_cancel_ends_the_request_with_499(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(lambda _: [("delta", "a", (1,)), ("sleep", 30.0)])
    gate = harness(engine)
    sock = gate.dealer()
    _send(sock, {"v": 1, "type": "completion", "id": "r", "prompt": "Hi"})
    assert _recv(sock)["type"] == "delta"
    _send(sock, {"v": 1, "type": "cancel", "id": "r"})
    _send(sock, {"v": 1, "type": "cancel", "id": "r"})  # idempotent
    _send(sock, {"v": 1, "type": "cancel", "id": "unknown"})
    end = _until(sock)[-1]
    assert (end["type"], end["code"], end["error"], end["id"]) == ("error", 499, "request_cancelled", "r")
    assert len(engine.cancelled) == 1
    _send(sock, {"v": 1, "type": "ping"})
    assert _recv(sock)["type"] == "pong"  # nothing else came after the 499


def test_breaking_a_client_stream_cancels_at_the_engine(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(lambda _: [("delta", "a", (1,)), ("sleep", 30.0)])
    gate = harness(engine)
    with gate.client() as client:
        for delta in client.stream("Hi"):
            assert delta.text == "a"
            break
        engine.wait_cancelled()
        engine.script = _hello
        assert client.complete("Hi").text == "Hello"


def test_a_silent_client_has_its_requests_cancelled(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(lambda _: [("sleep", 30.0)])
    gate = harness(engine, client_silence_s=0.5)
    sock = gate.dealer()
    _send(sock, {"v": 1, "type": "completion", "id": "a", "prompt": "Hi"})
    _send(sock, {"v": 1, "type": "completion", "id": "b", "prompt": "Hi"})
    started = time.monotonic()
    engine.wait_cancelled(2, timeout_s=3.0)
    assert 0.5 < time.monotonic() - started < 2.0
    assert gate.status_count(499) == 2
    assert gate.api.outstanding == 0


def test_a_pinging_client_is_kept(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(lambda _: [("sleep", 1.2), *_hello(_)])
    gate = harness(engine, client_silence_s=0.5)
    with gate.client(heartbeat_s=0.1) as client:
        assert client.complete("Hi").text == "Hello"  # 1.2 s of silence from the engine, pings all along
    assert engine.cancelled == []


def test_a_disconnected_client_is_dropped_when_its_frames_cannot_go(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(lambda _: [step for _ in range(200) for step in (("delta", "a", (1,)), ("sleep", 0.02))])
    gate = harness(engine)  # silence limit 15 s: only the failed send can notice this fast
    sock = gate.dealer()
    _send(sock, {"v": 1, "type": "completion", "id": "r", "prompt": "Hi"})
    assert _recv(sock)["type"] == "delta"
    sock.close(linger=0)
    engine.wait_cancelled(timeout_s=3.0)


def test_a_client_that_never_reads_is_cut_off_within_its_budget_and_others_are_served(
    harness: Callable[..., Harness],
) -> None:
    engine = FakeEngine(lambda request: [("sleep", 30.0)] if request.prompt == "hog" else _hello(request))
    budget = SendBudget(max_bytes=256 << 10)
    gate = harness(engine, send_budget=budget)
    hog = gate.ctx.socket(zmq.DEALER)
    gate.sockets.append(hog)
    hog.setsockopt(zmq.LINGER, 0)
    hog.setsockopt(zmq.RCVBUF, 4096)  # fill the kernel's buffers soon: the gateway's queue is what is tested
    hog.connect(gate.endpoint)
    _send(hog, {"v": 1, "type": "completion", "id": "held", "prompt": "hog"})
    _eventually(lambda: bool(engine.submitted))
    # each ping is answered with a pong and 256 error frames (47 KB): the hog reads none of them
    ping = json.dumps({"v": 1, "type": "ping", "waiting": [f"lost-{i}" for i in range(256)]}).encode()
    outbox = gate.api.sender.outbox
    sent, deadline = 0, time.monotonic() + 30.0
    while outbox.cut_offs == 0:
        assert time.monotonic() < deadline, f"the hog was not cut off within 30 s, after {sent} pings"
        try:
            hog.send(ping, flags=zmq.DONTWAIT)
            sent += 1
        except zmq.Again:
            time.sleep(0.001)
    assert 0 < outbox.peak_bytes <= budget.max_bytes
    engine.wait_cancelled()  # its request was cancelled, unanswered
    assert gate.status_count(499) == 1
    assert gate.metrics.registry.get_sample_value("skippy_gateway_zmq_clients_cut_off_total") == 1.0
    for _ in range(20):  # later messages of the hog get nothing queued
        _send(hog, ping)
    with gate.client() as client:
        assert client.complete("Hi").text == "Hello"
        assert client.info().ready
    _eventually(lambda: outbox.backlogged() == [])  # the loop thread marks a frame taken after libzmq sent it
    assert outbox.cut_offs == 1
    assert outbox.peak_bytes <= budget.max_bytes


def test_a_client_whose_queue_stands_still_is_cut_off_and_one_that_reads_is_not(
    harness: Callable[..., Harness],
) -> None:
    def script(request: GenerationRequest) -> list[Step]:
        # the hog's 20 MB of deltas, as fast as they come, outgrow the kernel's buffers; the reader's 1 MB
        size, count = (1000, 20_000) if request.prompt == "hog" else (200, 5000)
        return [*[("delta", "a" * size, (1,))] * count, ("done", "length", "a", [1])]

    engine = FakeEngine(script)
    # The hog's 20,000 frames pass the budget's 16,384 whatever the clock; the stall rule is set long,
    # so a reader slowed by a busy host is never mistaken for one that stopped reading.
    gate = harness(engine, send_budget=SendBudget(max_bytes=64 << 20, stall_s=5.0))
    hog = gate.ctx.socket(zmq.DEALER)
    gate.sockets.append(hog)
    hog.setsockopt(zmq.LINGER, 0)
    hog.setsockopt(zmq.RCVBUF, 4096)
    hog.connect(gate.endpoint)
    with gate.client() as reader:  # reads everything: its queue moves, however long it gets
        _send(hog, {"v": 1, "type": "completion", "id": "r", "prompt": "hog"})
        assert len(list(reader.stream("Hi"))) == 5001
    outbox = gate.api.sender.outbox
    counted = gate.metrics.registry.get_sample_value
    # The sender thread counts the cut-off in the outbox, then logs it and counts it in the metric:
    # wait for both, never read one right after seeing the other.
    _eventually(lambda: outbox.cut_offs == 1 and counted("skippy_gateway_zmq_clients_cut_off_total") == 1.0,
                timeout_s=10.0)  # the hog, over its frame budget
    _eventually(lambda: outbox.backlogged() == [])


def test_the_deadline_guard_ends_a_request_the_engine_forgot(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(lambda _: [("sleep", 30.0)])
    engine.request_timeout_s = -9.7  # the engine's deadline plus the 10 s grace: 0.3 s
    gate = harness(engine)
    with gate.client(heartbeat_s=0.1) as client, pytest.raises(GatewayTimeout) as caught:
        client.complete("Hi")
    assert (caught.value.code, caught.value.kind) == (504, "request_timeout")
    engine.wait_cancelled()


def test_close_answers_outstanding_requests_with_503(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(lambda _: [("sleep", 30.0)])
    gate = harness(engine)
    sock = gate.dealer()
    _send(sock, {"v": 1, "type": "completion", "id": "r", "prompt": "Hi"})
    _eventually(lambda: bool(engine.submitted))
    gate.call(gate.api.close())
    answer = _recv(sock)
    assert (answer["id"], answer["code"], answer["error"]) == ("r", 503, "pipeline_unavailable")
    engine.wait_cancelled()


def test_a_taken_endpoint_is_a_config_error(harness: Callable[..., Harness]) -> None:
    gate = harness(FakeEngine(_hello))

    async def clash() -> None:
        ZmqRequestApi(gate.backend, gate.endpoint, context=gate.actx)

    with pytest.raises(ConfigError, match=r"--zmq-bind tcp://127\.0\.0\.1:\d+: cannot bind"):
        gate.call(clash())


# --- end to end through `skippy-zmq serve` (slow: starts processes) ----------------------------------


class ServeProcess:
    """`python -m skippy_zmq.gateway.command` with JSON logs on stderr, read by a thread."""

    def __init__(self, *args: str) -> None:
        command = [sys.executable, "-m", "skippy_zmq.gateway.command", *args, "--port", "0", "--log-json"]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    def event(self, name: str, timeout_s: float) -> Frame:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                with contextlib.suppress(json.JSONDecodeError):
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("event") == name:
                        return record
            assert self.process.poll() is None, "".join(self.lines[-30:])
            time.sleep(0.05)
        raise AssertionError(f"no {name!r} event within {timeout_s} s:\n{''.join(self.lines[-30:])}")

    def http(self, url: str, body: Frame | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
        return json.loads(raw) if body is not None else raw.decode()

    def stop(self, timeout_s: float = 40.0) -> int:
        try:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
            return self.process.wait(timeout_s)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait(5)
            self._reader.join(5)


def _running_sessions(metrics_text: str) -> float:
    match = re.search(r"^skippy_gateway_running_sessions (\S+)$", metrics_text, re.MULTILINE)
    assert match is not None, metrics_text
    return float(match.group(1))


@pytest.mark.slow
def test_serve_zmq_end_to_end(tiny_gemma3_path: Path) -> None:
    """The request API of a real `serve` (local 2-stage pipeline on the tiny model): greedy text equals the
    HTTP API's, streams equal whole answers, embeddings equal POST /v1/embeddings', errors are typed, a
    broken-off stream frees its lane."""
    serve = ServeProcess("--model", str(tiny_gemma3_path), "--stages", "2", "--lanes", "2", "--ctx-size", "256",
                         "--zmq-bind", "tcp://127.0.0.1:*", "--ready-timeout", "120")
    try:
        url = serve.event("listening", 30)["url"]
        endpoint = serve.event("zmq_listening", 30)["endpoint"]
        with Client(endpoint, timeout_s=30.0, heartbeat_s=1.0) as client:
            deadline = time.monotonic() + 120
            while not client.info().ready:
                assert time.monotonic() < deadline, "".join(serve.lines[-30:])
                time.sleep(0.2)
            info = client.info()
            assert (info.model, info.ctx_size, info.versions) == (tiny_gemma3_path.stem, 256, (1,))
            for prompt in ("hello world", "once upon a time"):
                out = client.complete(prompt, max_tokens=12, temperature=0, ignore_eos=True)
                http = serve.http(url + "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                           "ignore_eos": True})
                assert out.text == http["choices"][0]["text"]
                assert (out.finish_reason, out.usage.completion_tokens, len(out.token_ids)) == ("length", 12, 12)
                # The HTTP request continued the session the ZeroMQ one left (the prompt cache).
                assert out.usage == attrs.evolve(type(out.usage).from_json(http["usage"]), cached_tokens=0)
                assert http["usage"]["prompt_tokens_details"]["cached_tokens"] == out.usage.prompt_tokens - 1
                deltas = list(client.stream(prompt, max_tokens=12, temperature=0, ignore_eos=True))
                assert "".join(d.text for d in deltas) == out.text
                assert tuple(t for d in deltas for t in d.token_ids) == out.token_ids
                assert deltas[-1].finish_reason == "length"
                ids = client.tokenize(prompt, add_special=True)  # the ids the completion ran on
                assert len(ids) == out.usage.prompt_tokens and client.tokenize(prompt) == ids[1:]
                assert client.detokenize(ids) == prompt and client.detokenize(out.token_ids) == out.text
            texts = ["hello world", "once upon a time"]
            http = serve.http(url + "/v1/embeddings", {"input": texts})
            ours = client.embed(texts)
            assert ours == client.embed(texts, encoding_format="base64")  # the same float32s either way
            assert ours.usage.prompt_tokens == http["usage"]["prompt_tokens"] and ours.model == http["model"]
            for vector, item in zip(ours.vectors, http["data"], strict=True):
                a, b = np.asarray(vector, dtype=np.float64), np.asarray(item["embedding"], dtype=np.float64)
                assert abs(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) - 1.0) < 1e-6
            with pytest.raises(GatewayRequestError) as outside:
                client.detokenize([10**6])
            assert (outside.value.code, outside.value.param) == (400, "tokens")
            answer = client.chat([{"role": "user", "content": "hi"}], max_tokens=5, temperature=0)
            assert answer.finish_reason in ("stop", "length")
            assert client.complete("hi", model="another-model", max_tokens=1).finish_reason == "length"
            for delta in client.stream("hello", max_tokens=200, ignore_eos=True, temperature=0):
                assert delta.token_ids
                break
            deadline = time.monotonic() + 10
            while _running_sessions(serve.http(url + "/metrics")) != 0:
                assert time.monotonic() < deadline, "the broken-off stream still holds its lane"
                time.sleep(0.1)
            assert client.complete("hello", max_tokens=3, temperature=0).usage.completion_tokens <= 3
        assert serve.stop() == 0
    finally:
        serve.stop()



def test_with_curve_only_clients_in_clients_dir_are_served(harness: Callable[..., Harness], tmp_path: Path) -> None:
    from skippy_zmq.config import TopologyConfig
    from skippy_zmq.gateway.options import ServeLog
    from skippy_zmq.gateway.server import refusal_reporter
    from skippy_zmq.security.curve import CurveSetup
    from skippy_zmq.security.keys import KeyStore, keygen
    from tests.security.test_curve import TOPOLOGY

    path = tmp_path / "t.toml"
    path.write_text(TOPOLOGY.format(clients='clients_dir = "clients"'))
    topology = TopologyConfig.from_toml(path)
    keygen(topology)
    store = KeyStore.of(topology.security)
    _public, alice, _admitted = store.ensure_client("alice")
    metrics_holder: list[GatewayMetrics] = []
    curve = CurveSetup.for_driver(topology, request_api=True)

    def on_refused(*args: Any) -> None:  # the harness makes its metrics after the API's options
        refusal_reporter(metrics_holder[0], ServeLog(json_lines=True, stream=io.StringIO()))(*args)

    gate = harness(FakeEngine(_hello), curve=curve, on_handshake_refused=on_refused)
    metrics_holder.append(gate.metrics)
    server_key = store.public_path("driver")
    with gate.client(server_key=server_key, client_keys=alice) as client:
        assert client.complete("Hi", max_tokens=5).text == "Hello"
    # A stranger with a key pair of its own, and a client without CURVE, get nothing answered.
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    _, stranger_secret = zmq.auth.create_certificates(stranger, "stranger")
    Path(stranger_secret).chmod(0o600)
    for options in ({"server_key": server_key, "client_keys": stranger_secret}, {}):
        # refused at the handshake: the send finds no peer (unreachable) or nothing ever answers
        with gate.client(timeout_s=0.5, **options) as client, pytest.raises((GatewayTimeout, GatewayUnavailable)):
            client.complete("Hi", max_tokens=5)
    refused = gate.metrics.registry.get_sample_value("skippy_gateway_handshakes_refused_total",
                                                     {"domain": "skippy.requests"})
    assert refused is not None and refused >= 1
    with pytest.raises(RequestError, match="server_key needs client_keys"):
        Client(gate.endpoint, context=gate.ctx, server_key=server_key)


# --- logprobs, n, tokenize and detokenize (docs/PROTOCOL.md §8.2, §8.3) ----------------------------


def _result(choice: int, text: str, tokens: list[int], reason: str = "eos", **fields: Any) -> GenerationResult:
    return GenerationResult(prompt="Hi", prompt_ids=[72, 105], choice=choice, text=text, tokens=tokens,
                            finish_reason=reason, **fields)


def test_frames_of_a_plain_request_keep_version_1s_fields_only() -> None:
    delta = Delta("Hel", (72,), 0, (TokenLogprobs(72, -0.5),))  # logprobs nobody asked for stay home
    assert delta_frame("r", delta) == {"v": 1, "type": "delta", "id": "r", "text": "Hel", "token_ids": [72]}
    assert final_frame("r", [_result(0, "Hel", [72])], "tiny") == {
        "v": 1, "type": "final", "id": "r", "finish_reason": "stop", "text": "Hel", "token_ids": [72],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}, "model": "tiny"}


def test_logprobs_travel_as_ids_one_per_token_and_minus_infinity_as_null() -> None:
    streamed, whole = FrameShape(logprobs=True), FrameShape(logprobs=True, streamed=False)
    logprobs = (TokenLogprobs(72, -0.5, ((72, -0.5), (9, -1.25))), TokenLogprobs(108, float("-inf")))
    frame = delta_frame("r", Delta("Hel", (72, 108), 0, logprobs), streamed)
    assert frame["logprobs"] == [{"token": 72, "logprob": -0.5, "top": [[72, -0.5], [9, -1.25]]},
                                 {"token": 108, "logprob": None, "top": []}]
    assert "choice" not in frame
    assert json.loads(encode_frame(frame).decode("utf-8")) == frame  # strict JSON: no -Infinity
    results = [_result(0, "Hel", [72, 108], logprobs=list(logprobs))]
    assert "logprobs" not in final_frame("r", results, "tiny", streamed)  # the deltas carried them
    final = final_frame("r", results, "tiny", whole)
    assert final["logprobs"] == frame["logprobs"]
    assert "choices" not in final


def test_a_float32_logprob_is_written_with_the_fewest_digits_that_read_back_the_same() -> None:
    value = float(np.float32(-0.1))  # -0.10000000149011612 as a float64
    [entry] = delta_frame("r", Delta("a", (1,), 0, (TokenLogprobs(1, value, ((1, value),)),)),
                          FrameShape(logprobs=True))["logprobs"]
    assert encode_frame(entry) == b'{"token":1,"logprob":-0.1,"top":[[1,-0.1]]}'
    assert np.float32(entry["logprob"]) == np.float32(value)


def test_a_whole_answer_of_two_choices_has_logprobs_in_each_choice_only() -> None:
    lp = [TokenLogprobs(65, -0.5)]
    final = final_frame("r", [_result(0, "a", [65], logprobs=lp), _result(1, "a", [65], logprobs=lp)], "tiny",
                        FrameShape(choices=True, logprobs=True, streamed=False))
    assert "logprobs" not in final  # choice 0's are in choices[0]: not written twice
    assert [choice["logprobs"] for choice in final["choices"]] == [[{"token": 65, "logprob": -0.5, "top": []}]] * 2


def test_a_request_of_two_choices_has_tagged_deltas_a_choices_list_and_openai_usage() -> None:
    shape = FrameShape(choices=True)
    assert delta_frame("r", Delta("b", (66,), 1), shape)["choice"] == 1
    assert delta_frame("r", Delta("a", (65,)), shape)["choice"] == 0  # tagged even for choice 0
    results = [_result(0, "a!", [65, 33]), _result(1, "bb", [66, 66, 66], "length")]
    final = final_frame("r", results, "tiny", shape)
    assert (final["text"], final["token_ids"], final["finish_reason"]) == ("a!", [65, 33], "stop")  # choice 0
    assert final["choices"] == [
        {"index": 0, "finish_reason": "stop", "text": "a!", "token_ids": [65, 33]},
        {"index": 1, "finish_reason": "length", "text": "bb", "token_ids": [66, 66, 66]}]
    assert final["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}  # the prompt once


def test_frame_shape_follows_what_the_request_asked() -> None:
    plain = CompletionParams(Endpoint.COMPLETIONS, prompt="x")
    assert FrameShape.of(plain) == FrameShape(choices=False, logprobs=False, streamed=False)
    assert FrameShape.of(attrs.evolve(plain, n=3, logprobs=0, stream=True)) == FrameShape(True, True, True)


def test_tokenize_and_detokenize_answers() -> None:
    tokenizer: Any = FakeTokenizer()
    assert text_answer(tokenizer, Tokenize("t", "Hi", True)) == {"v": 1, "type": "tokens", "id": "t",
                                                                 "tokens": [2, 72, 105]}
    assert text_answer(tokenizer, Tokenize("t", "Hi"))["tokens"] == [72, 105]
    assert text_answer(tokenizer, Detokenize("d", (72, 105))) == {"v": 1, "type": "text", "id": "d", "content": "Hi"}
    with pytest.raises(ApiError) as outside:
        text_answer(tokenizer, Detokenize("d", (72, 1000)))
    assert (outside.value.status, outside.value.param) == (400, "tokens")
    assert "token id 1000; the vocabulary has ids 0..999" in outside.value.message


def test_client_tokenize_and_detokenize_through_the_router(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(_hello)
    gate = harness(engine)
    with gate.client() as client:
        assert client.tokenize("Hi") == (72, 105)
        assert client.tokenize("Hi", add_special=True) == (2, 72, 105)
        assert client.detokenize([72, 105]) == "Hi"
        with pytest.raises(GatewayRequestError) as caught:
            client.detokenize([5000])
        assert (caught.value.code, caught.value.param) == (400, "tokens")
    assert engine.submitted == []  # answered without the engine
    assert gate.status_count(200) == 3 and gate.status_count(400) == 1
    assert gate.api.outstanding == 0


@pytest.mark.parametrize("ask", [lambda client: client.tokenize("Hi"), lambda client: client.embed("Hi")],
                         ids=["tokenize", "embed"])
def test_a_tokenize_or_embed_while_the_pipeline_starts_is_503(harness: Callable[..., Harness],
                                                               ask: Callable[[Any], object]) -> None:
    with harness(None).client() as client, pytest.raises(GatewayUnavailable):
        ask(client)


def test_a_running_tokenize_is_outstanding_pings_hold_it_and_a_cancel_ends_it_with_499(
    harness: Callable[..., Harness],
) -> None:
    hold = threading.Event()
    gate = harness(FakeEngine(_hello), FakeTokenizer(hold), max_requests_per_client=1)
    sock = gate.dealer()
    try:
        _send(sock, {"v": 1, "type": "tokenize", "id": "t1", "content": "Hi"})
        _eventually(lambda: gate.api.outstanding == 1)
        _send(sock, {"v": 1, "type": "tokenize", "id": "t2", "content": "Hi"})
        capped = _recv(sock)
        assert (capped["id"], capped["code"], capped["error"]) == ("t2", 429, "too_many_requests")
        _send(sock, {"v": 1, "type": "ping", "waiting": ["t1"]})
        assert _recv(sock) == {"v": 1, "type": "pong", "ready": True}  # and no 404: t1 is held
        _send(sock, {"v": 1, "type": "cancel", "id": "t1"})
        _send(sock, {"v": 1, "type": "ping", "id": "after"})  # one client's messages are handled in order
        assert _recv(sock) == {"v": 1, "type": "pong", "ready": True, "id": "after"}
    finally:
        hold.set()
    ended = _recv(sock)
    assert (ended["type"], ended["id"], ended["code"]) == ("error", "t1", 499)
    _send(sock, {"v": 1, "type": "tokenize", "id": "t3", "content": "A"})
    assert _recv(sock) == {"v": 1, "type": "tokens", "id": "t3", "tokens": [65]}


def test_client_streams_two_choices_with_logprobs(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(_choices)
    gate = harness(engine)
    with gate.client() as client:
        deltas = list(client.stream("Hi", n=2, logprobs=1))
    request = engine.submitted[0].request
    assert (request.n, request.logprobs) == (2, 1)
    assert [(d.choice, d.text, d.token_ids) for d in deltas[:4]] == [
        (0, "c0", (60,)), (1, "c1", (61,)), (1, "!", (33,)), (0, "!", (33,))]
    assert deltas[0].logprobs == (TokenLogprob(60, -0.25, ((61, -1.0),)),)
    closing = deltas[4:]
    usage = Usage(2, 4, 6)
    assert closing == [StreamDelta("", (), "stop", None, 0, ()), StreamDelta("", (), "length", usage, 1, ())]


def test_client_completes_two_choices_with_logprobs(harness: Callable[..., Harness]) -> None:
    gate = harness(FakeEngine(_choices))
    with gate.client() as client:
        out = client.complete("Hi", n=2, logprobs=0, stream=False)
    top0 = (TokenLogprob(60, -0.25), TokenLogprob(33, -0.25))
    assert out.choices == (Choice(0, "c0!", (60, 33), "stop", top0),
                           Choice(1, "c1!", (61, 33), "length", (TokenLogprob(61, -0.25), TokenLogprob(33, -0.25))))
    assert (out.text, out.logprobs, out.usage) == ("c0!", top0, Usage(2, 4, 6))
    assert gate.metrics.registry.get_sample_value("skippy_gateway_completion_tokens_total") == 4


def test_chat_top_logprobs_reach_the_engine_and_come_back(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(_choices)
    gate = harness(engine)
    with gate.client() as client:
        out = client.chat([{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=2)
    assert engine.submitted[0].request.logprobs == 2
    assert out.logprobs is not None and out.logprobs[0].top == ((61, -1.0), (62, -2.0))
    assert len(out.choices) == 1


# --- embed (docs/PROTOCOL.md §8.2, §8.3) -------------------------------------------------------------


def _vectors(frame: Frame) -> list[np.ndarray[Any, np.dtype[np.float32]]]:
    return [np.array(item["embedding"], dtype=np.float32) for item in frame["data"]]


def test_an_embed_of_two_inputs_is_one_request_answered_by_one_embedding_frame(
    harness: Callable[..., Harness],
) -> None:
    engine = FakeEngine(_embeds)
    gate = harness(engine)
    sock = gate.dealer()
    _send(sock, {"v": 1, "type": "embed", "id": "e", "input": ["Hi", [5, 6, 7]]})
    frame = _recv(sock)
    assert set(frame) == {"v", "type", "id", "data", "model", "usage"}
    assert (frame["type"], frame["id"], frame["model"]) == ("embedding", "e", "tiny")
    assert [item["index"] for item in frame["data"]] == [0, 1] and all(set(i) == {"index", "embedding"}
                                                                       for i in frame["data"])
    expected = [fake_vector([72, 105]), fake_vector([5, 6, 7])]  # "Hi" with no BOS, as /v1/embeddings
    for got, want in zip(_vectors(frame), expected, strict=True):
        np.testing.assert_array_equal(got, want)  # the float32 values exactly
    # each value the shortest decimal that reads back as the same float32 (as logprobs, §8.3)
    assert frame["data"][0]["embedding"] == [float(str(value)) for value in expected[0]]
    assert frame["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    requests = [ticket.request for ticket in engine.submitted]
    assert [(r.prompt_ids, r.embedding, r.max_tokens) for r in requests] == [
        ((72, 105), Pooling.MEAN, 0), ((5, 6, 7), Pooling.MEAN, 0)]
    assert gate.status_count(200) == 1 and gate.api.outstanding == 0
    assert gate.metrics.registry.get_sample_value("skippy_gateway_prompt_tokens_total") == 5


def test_client_embed_floats_and_base64_are_the_same_float32s(harness: Callable[..., Harness]) -> None:
    gate = harness(FakeEngine(_embeds))
    with gate.client() as client:
        floats = client.embed(["Hi", "Hello"])
        packed = client.embed(["Hi", "Hello"], encoding_format="base64", model="tiny", dimensions=N_EMBD)
        one = client.embed("Hi")
        ids = client.embed([[5, 6, 7], np.array([8, 9])], timeout_s=2.0)
    assert floats == packed and floats.model == "tiny" and floats.usage == Usage(7, 0, 7)
    assert isinstance(floats, Embeddings) and len(floats.vectors) == 2
    np.testing.assert_array_equal(np.asarray(floats.vectors, dtype=np.float32),
                                  [fake_vector([72, 105]), fake_vector([ord(c) for c in "Hello"])])
    assert one.vectors == floats.vectors[:1]
    np.testing.assert_array_equal(np.asarray(ids.vectors[1], dtype=np.float32), fake_vector([8, 9]))


def test_a_bad_embed_input_is_a_400_naming_it(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(_embeds)
    gate = harness(engine)
    sock = gate.dealer()
    _send(sock, {"v": 1, "type": "embed", "id": "e", "input": ["ok", 7.5]})
    refused = _recv(sock)
    assert (refused["id"], refused["code"], refused["param"], refused["refused"]) == ("e", 400, "input[1]", True)
    with gate.client() as client:
        with pytest.raises(GatewayRequestError) as outside:
            client.embed(["ok", [5000]])  # checked against the vocabulary when prepared
        assert (outside.value.code, outside.value.param) == (400, "input[1]")
        assert "token id 5000; the vocabulary has ids 0..999" in str(outside.value)
        with pytest.raises(GatewayRequestError) as long:
            client.embed(["ok", "x" * 64])  # the context is 64 tokens
        assert (long.value.code, long.value.kind, long.value.param) == (400, "context_length_exceeded", "input[1]")
        with pytest.raises(GatewayRequestError) as width:
            client.embed("ok", dimensions=8)
        assert (width.value.code, width.value.param) == (400, "dimensions")
    gate.backend.strict_model_name = True  # the default serves any name, as the HTTP routes
    with gate.client() as client:
        with pytest.raises(GatewayRequestError) as model:
            client.embed("ok", model="another")
        assert (model.value.code, model.value.kind) == (404, "model_not_found")
    assert engine.submitted == [] and gate.api.outstanding == 0


def test_cancelling_an_embed_cancels_every_inputs_run_with_one_499(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(lambda _: [("sleep", 30.0)])
    gate = harness(engine)
    sock = gate.dealer()
    _send(sock, {"v": 1, "type": "embed", "id": "e", "input": ["a", "b", "c"]})
    _eventually(lambda: len(engine.submitted) == 3)
    _send(sock, {"v": 1, "type": "cancel", "id": "e"})
    ended = _recv(sock)
    assert (ended["type"], ended["id"], ended["code"], ended["error"]) == ("error", "e", 499, "request_cancelled")
    engine.wait_cancelled(3)
    assert set(engine.cancelled) == set(engine.submitted)
    _send(sock, {"v": 1, "type": "ping"})
    assert _recv(sock)["type"] == "pong"  # one 499 for the request, nothing for its other runs
    assert gate.status_count(499) == 1


def test_an_embed_of_many_inputs_is_one_request_under_the_cap(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(lambda _: [("sleep", 30.0)])
    gate = harness(engine, max_requests_per_client=1)
    sock = gate.dealer()
    _send(sock, {"v": 1, "type": "embed", "id": "e", "input": ["a", "b", "c"]})
    _eventually(lambda: len(engine.submitted) == 3)
    assert gate.api.outstanding == 1
    _send(sock, {"v": 1, "type": "ping", "waiting": ["e"]})
    assert _recv(sock) == {"v": 1, "type": "pong", "ready": True}  # no 404: e is held
    _send(sock, {"v": 1, "type": "embed", "id": "f", "input": "d"})
    capped = _recv(sock)
    assert (capped["id"], capped["code"], capped["error"]) == ("f", 429, "too_many_requests")
    _send(sock, {"v": 1, "type": "cancel", "id": "e"})
    assert _recv(sock)["code"] == 499
    engine.script = _embeds
    _send(sock, {"v": 1, "type": "embed", "id": "f", "input": "d"})  # the slot is free again
    assert _recv(sock)["type"] == "embedding"


def test_one_input_failing_fails_the_embed_and_cancels_the_others(harness: Callable[..., Harness]) -> None:
    def script(request: GenerationRequest) -> list[Step]:
        return [("fail", RemoteStageError("stage-1 answered an error"))] if request.prompt == "bad" else [
            ("sleep", 30.0)]

    engine = FakeEngine(script)
    gate = harness(engine)
    with gate.client() as client, pytest.raises(GatewayError) as caught:
        client.embed(["a", "bad", "c"])
    assert caught.value.code == 500 and "stage-1" in str(caught.value)
    engine.wait_cancelled(3)  # the failed run's cancel is idempotent at the engine
    assert gate.api.outstanding == 0


def test_a_queue_full_part_way_is_a_429_and_cancels_the_inputs_submitted(harness: Callable[..., Harness]) -> None:
    engine = FakeEngine(lambda _: [("sleep", 30.0)], refuse=QueueFull("the queue is full"), refuse_after=1)
    gate = harness(engine)
    with gate.client() as client, pytest.raises(GatewayBusy) as caught:
        client.embed(["a", "b"])
    assert caught.value.code == 429
    engine.wait_cancelled(1)
    assert engine.cancelled == engine.submitted and len(engine.submitted) == 1
    assert gate.api.outstanding == 0


def test_an_embed_whose_answer_could_exceed_the_send_budget_is_refused_before_it_runs(
    harness: Callable[..., Harness],
) -> None:
    engine = FakeEngine(_embeds)
    gate = harness(engine, send_budget=SendBudget(max_bytes=4000))  # half of it for an answer
    with gate.client() as client:
        with pytest.raises(GatewayRequestError) as caught:
            client.embed(["x"] * 100)
        assert (caught.value.code, caught.value.param) == (400, "input")
        assert "send at most 16 inputs per embed as floats, or 25 with encoding_format base64" in str(caught.value)
        assert len(client.embed(["x"] * 16).vectors) == 16
        assert len(client.embed(["x"] * 25, encoding_format="base64").vectors) == 25
    assert len(engine.submitted) == 16 + 25


def test_the_embedding_frame_bound_holds_the_frame_and_the_default_budget_takes_many_inputs() -> None:
    worst = np.full(640, -1.1754944e-38, dtype=np.float32)  # the longest float32 text
    gather = EmbeddingGather(EmbeddingParams(("x",) * 3), 3)
    for index in range(3):
        gather.take(index, Done(_result(0, "", [], embedding=worst)))
    request_id = "r" * 128
    assert len(encode_frame(gather.frame(request_id, "m" * 100))) <= embedding_frame_bytes(3, 640, "float")
    packed = EmbeddingGather(EmbeddingParams(("x",) * 3, encoding_format="base64"), 3)
    packed.results = gather.results
    assert len(encode_frame(packed.frame(request_id, "m" * 100))) <= embedding_frame_bytes(3, 640, "base64")
    budget = SendBudget().max_bytes
    check_embedding_size(EmbeddingParams(("x",) * 435), 640, budget)  # Gemma 3 270M's width
    check_embedding_size(EmbeddingParams(("x",) * 1213, encoding_format="base64"), 640, budget)
    with pytest.raises(ApiError, match="input holds 436 inputs of 640 values each") as caught:
        check_embedding_size(EmbeddingParams(("x",) * 436), 640, budget)
    assert caught.value.param == "input" and "send at most 435 inputs per embed as floats, or 1213" in str(caught.value)
    check_embedding_size(EmbeddingParams(("x",) * 2048), None, budget)  # width unknown: not bounded


def test_an_embedding_gather_answers_in_input_order_and_refuses_a_missing_vector() -> None:
    gather = EmbeddingGather(EmbeddingParams(("a", "b")), 2)
    assert gather.take(1, Delta("", ())) is False
    assert gather.take(1, Done(_result(0, "", [], embedding=fake_vector([1])))) is False
    assert gather.take(0, Done(_result(0, "", [], embedding=fake_vector([2])))) is True
    frame = gather.frame("e", "tiny")
    np.testing.assert_array_equal(_vectors(frame)[0], fake_vector([2]))  # index 0 first, whatever came first
    assert frame["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    failed = gather.take(0, Failed(RemoteStageError("boom"), _result(0, "", [])))
    assert isinstance(failed, ApiError) and failed.status == 500
    missing = EmbeddingGather(EmbeddingParams(("a",)), 1).take(0, Done(_result(0, "", [])))
    assert isinstance(missing, ApiError) and "without its vector" in missing.message
