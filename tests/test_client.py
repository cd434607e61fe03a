"""skippy_zmq.Client against a scripted in-process ROUTER (no gateway, no engine)."""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq import Client
from skippy_zmq.client import SilenceRule, _decode, _parsed
from skippy_zmq.errors import (
    EngineUnavailable,
    GatewayBusy,
    GatewayCancelled,
    GatewayError,
    GatewayRequestError,
    GatewayTimeout,
    GatewayUnavailable,
    QueueFull,
    RequestError,
    WireError,
)
from skippy_zmq.wire.request_api import (
    MAX_FRAME_BYTES,
    Choice,
    Completion,
    Embeddings,
    GatewayInfo,
    StreamDelta,
    TokenLogprob,
    Usage,
    content_from_frame,
    error_from_frame,
    tokens_from_frame,
)
from tests.strategies import hostile_json

Frame = dict[str, Any]
Handler = Callable[[Frame], list[Frame]]


class ScriptedGateway:
    """A ROUTER on 127.0.0.1 answering each client frame with what `handler` returns."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.received: list[Frame] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, data = self._sock.recv_multipart()
            frame = json.loads(data)
            self.received.append(frame)
            for answer in self.handler(frame):
                raw = answer.pop("_raw", None)
                self._sock.send_multipart([identity, raw if raw is not None else json.dumps(answer).encode()])

    def of_type(self, kind: str) -> list[Frame]:
        return [frame for frame in list(self.received) if frame["type"] == kind]

    def wait_for(self, kind: str, timeout_s: float = 5.0) -> Frame:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.of_type(kind)
            if found:
                return found[0]
            time.sleep(0.01)
        raise AssertionError(f"no {kind!r} frame within {timeout_s} s; got {self.received}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()


def _delta(request_id: str, text: str, ids: list[int]) -> Frame:
    return {"v": 1, "type": "delta", "id": request_id, "text": text, "token_ids": ids}


def _final(request_id: str, text: str, ids: list[int], reason: str = "stop") -> Frame:
    return {"v": 1, "type": "final", "id": request_id, "finish_reason": reason, "text": text, "token_ids": ids,
            "usage": {"prompt_tokens": 3, "completion_tokens": len(ids), "total_tokens": 3 + len(ids)},
            "model": "tiny"}


def _error(request_id: str | None, code: int, kind: str) -> Frame:
    return {"v": 1, "type": "error", "id": request_id, "code": code, "error": kind, "message": f"{kind} here",
            "param": "max_tokens" if code == 400 else None}


def _echo_completion(frame: Frame) -> list[Frame]:
    if frame["type"] in ("completion", "chat"):
        rid = frame["id"]
        return [_delta(rid, "Hel", [1]), _delta(rid, "lo", [2]), _final(rid, "Hello", [1, 2])]
    return []


@pytest.fixture
def scripted() -> Iterator[Callable[[Handler], ScriptedGateway]]:
    made: list[ScriptedGateway] = []

    def make(handler: Handler) -> ScriptedGateway:
        made.append(ScriptedGateway(handler))
        return made[-1]

    yield make
    for gateway in made:
        gateway.close()


def test_complete_sends_one_versioned_frame_and_returns_the_final(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    gateway = scripted(_echo_completion)
    with Client(gateway.endpoint, timeout_s=5) as client:
        out = client.complete("Hi", max_tokens=2, temperature=0)
    assert out == Completion("Hello", (1, 2), "stop", Usage(3, 2, 5), "tiny")
    request = gateway.of_type("completion")[0]
    assert request == {"v": 1, "type": "completion", "id": request["id"], "prompt": "Hi", "max_tokens": 2,
                       "temperature": 0}


def test_token_id_prompts_and_chat_messages_are_sent_as_json(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    gateway = scripted(_echo_completion)
    with Client(gateway.endpoint, timeout_s=5) as client:
        client.complete((5, 6, 7))
        client.chat([{"role": "user", "content": "Hi"}], max_completion_tokens=4)
    assert gateway.of_type("completion")[0]["prompt"] == [5, 6, 7]
    chat = gateway.of_type("chat")[0]
    assert chat["messages"] == [{"role": "user", "content": "Hi"}]
    assert chat["max_completion_tokens"] == 4


def test_stream_yields_deltas_then_a_closing_delta(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    gateway = scripted(_echo_completion)
    with Client(gateway.endpoint, timeout_s=5) as client:
        deltas = list(client.stream("Hi"))
        chat_deltas = list(client.chat_stream([{"role": "user", "content": "Hi"}]))
    assert deltas == [StreamDelta("Hel", (1,)), StreamDelta("lo", (2,)), StreamDelta("", (), "stop", Usage(3, 2, 5))]
    assert chat_deltas == deltas
    assert not gateway.of_type("cancel")


def test_leaving_a_stream_early_cancels_the_request(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    def slow(frame: Frame) -> list[Frame]:
        if frame["type"] == "completion":
            return [_delta(frame["id"], "a", [1]), _delta(frame["id"], "b", [2])]
        return []

    gateway = scripted(slow)
    with Client(gateway.endpoint, timeout_s=5) as client:
        for delta in client.stream("Hi"):
            assert delta.text == "a"
            break
        cancel = gateway.wait_for("cancel")
        assert cancel == {"v": 1, "type": "cancel", "id": gateway.of_type("completion")[0]["id"]}
        # the late frames of the cancelled request are dropped; the next request works
        gateway.handler = _echo_completion
        assert client.complete("again").text == "Hello"


@pytest.mark.parametrize(
    ("code", "error_class", "builtin"),
    [
        (400, GatewayRequestError, ValueError),
        (404, GatewayRequestError, RequestError),
        (409, GatewayRequestError, ValueError),
        (413, GatewayRequestError, ValueError),
        (429, GatewayBusy, QueueFull),
        (499, GatewayCancelled, GatewayError),
        (503, GatewayUnavailable, EngineUnavailable),
        (504, GatewayTimeout, TimeoutError),
        (500, GatewayError, GatewayError),
        (418, GatewayError, GatewayError),
    ],
)
def test_error_frames_raise_typed_errors_by_code(
    scripted: Callable[[Handler], ScriptedGateway], code: int, error_class: type[GatewayError], builtin: type[Exception]
) -> None:
    gateway = scripted(lambda frame: [_error(frame["id"], code, "some_kind")] if frame["type"] == "completion" else [])
    with Client(gateway.endpoint, timeout_s=5) as client:
        with pytest.raises(error_class) as caught:
            client.complete("Hi")
        with pytest.raises(error_class):
            list(client.stream("Hi"))
    assert type(caught.value) is error_class
    assert isinstance(caught.value, builtin)
    assert (caught.value.code, caught.value.kind) == (code, "some_kind")
    assert caught.value.request_id == gateway.of_type("completion")[0]["id"]
    assert not gateway.of_type("cancel")  # an error ends the request: nothing to cancel


def test_error_from_frame_tolerates_odd_fields() -> None:
    error = error_from_frame({"v": 1, "type": "error", "id": None, "code": True, "error": 7})
    assert (type(error), error.code, error.kind, error.request_id, error.param) == (
        GatewayError, 500, "internal_error", None, None)
    error = error_from_frame(_error("r", 400, "invalid_request"))
    assert error.param == "max_tokens"
    assert str(error) == "invalid_request here"


def test_a_silent_gateway_times_out_pinging_meanwhile_then_cancels(
    scripted: Callable[[Handler], ScriptedGateway],
) -> None:
    gateway = scripted(lambda frame: [])
    started = time.monotonic()
    # timeout_s is shorter than 3 ping intervals (0.75 s), so it ends the wait first
    with Client(gateway.endpoint, timeout_s=0.6, heartbeat_s=0.25) as client, pytest.raises(GatewayTimeout) as caught:
        client.complete("Hi")
    assert 0.5 < time.monotonic() - started < 3.0
    assert (caught.value.code, caught.value.kind) == (504, "no_reply")
    # A client without keys is told the silence may be a CURVE gateway refusing its handshake.
    assert str(caught.value).endswith("; if the gateway requires CURVE keys ([security] curve = true), pass "
                                      "server_key and client_keys (docs/PROTOCOL.md §10)")
    gateway.wait_for("cancel")
    assert len(gateway.of_type("ping")) >= 2
    request_id = gateway.of_type("completion")[0]["id"]
    assert gateway.of_type("ping")[0] == {"v": 1, "type": "ping", "waiting": [request_id]}


def test_a_gateway_that_stops_answering_is_gone_within_three_ping_intervals(
    scripted: Callable[[Handler], ScriptedGateway],
) -> None:
    # A live gateway answers every ping; this one answers the first three, then dies (says nothing).
    answered: list[float] = []

    def dying(frame: Frame) -> list[Frame]:
        if frame["type"] != "ping" or len(answered) == 3:
            return []
        answered.append(time.monotonic())
        return [{"v": 1, "type": "pong", "ready": True}]

    gateway = scripted(dying)
    heartbeat_s = 0.2
    with Client(gateway.endpoint, timeout_s=20.0, heartbeat_s=heartbeat_s) as client, \
            pytest.raises(GatewayUnavailable) as caught:
        client.complete("Hi")
    noticed_s = time.monotonic() - answered[-1]
    assert len(answered) == 3  # it was alive, and kept waiting while it answered
    assert 3 * heartbeat_s <= noticed_s < 3 * heartbeat_s + 1.0  # not the 20 s timeout
    error = caught.value
    assert isinstance(error, EngineUnavailable) and not isinstance(error, GatewayTimeout)
    assert (error.code, error.kind, error.request_id) == (503, "gateway_gone", "1")
    assert str(error).startswith(f"gateway {gateway.endpoint} answered none of the ")
    assert "pings sent in 0.6 s (3 ping intervals of 0.2 s) while request '1' waited: it is gone" in str(error)


def test_the_silence_rule_takes_the_sooner_of_the_timeout_and_three_ping_intervals() -> None:
    gone = SilenceRule(timeout_s=60.0, heartbeat_s=5.0)
    assert (gone.limit_s, gone.gone_after_s) == (15.0, 15.0)
    error = gone.error("tcp://h:1", "r7", 2, hint="; hint")
    assert (type(error), error.code, error.kind, error.request_id) == (GatewayUnavailable, 503, "gateway_gone", "r7")
    assert str(error) == ("gateway tcp://h:1 answered none of the 2 pings sent in 15 s (3 ping intervals of 5 s) "
                          "while request 'r7' waited: it is gone or unreachable; hint")
    timeout = SilenceRule(timeout_s=10.0, heartbeat_s=5.0)
    assert timeout.limit_s == 10.0
    error = timeout.error("tcp://h:1", "r7", 1)
    assert (type(error), error.code, error.kind) == (GatewayTimeout, 504, "no_reply")
    assert str(error) == "gateway tcp://h:1 sent nothing, not even a pong, for 10 s while request 'r7' waited"
    assert SilenceRule(timeout_s=15.0, heartbeat_s=5.0).error("e", "r", 2).kind == "no_reply"  # a tie: the timeout


def test_pongs_keep_a_queued_request_waiting_past_the_timeout(
    scripted: Callable[[Handler], ScriptedGateway],
) -> None:
    # A request queued behind others gets no frame of its own for a while; the gateway's pongs
    # say it is alive, so the client keeps waiting instead of timing out.
    def queued(frame: Frame) -> list[Frame]:
        if frame["type"] != "ping":
            return []
        if len(gateway.of_type("ping")) < 6:
            return [{"v": 1, "type": "pong", "ready": True}]
        rid = gateway.of_type("completion")[0]["id"]
        return [_final(rid, "late", [4])]

    gateway = scripted(queued)
    started = time.monotonic()
    with Client(gateway.endpoint, timeout_s=0.5, heartbeat_s=0.2) as client:
        out = client.complete("Hi")
    assert time.monotonic() - started > 0.9  # about six pings: well past timeout_s of silence on the request
    assert out.text == "late" and not gateway.of_type("cancel")


def test_a_gateway_that_no_longer_holds_the_request_ends_the_wait(
    scripted: Callable[[Handler], ScriptedGateway],
) -> None:
    # A restarted gateway pongs but does not know the request: it says so for each id the
    # ping names, and the wait ends instead of lasting as long as the pongs do.
    def forgetful(frame: Frame) -> list[Frame]:
        if frame["type"] != "ping":
            return []
        pong: Frame = {"v": 1, "type": "pong", "ready": True}
        return [pong, *({**_error(rid, 404, "unknown_request"), "param": "id"} for rid in frame["waiting"])]

    gateway = scripted(forgetful)
    with Client(gateway.endpoint, timeout_s=30, heartbeat_s=0.1) as client, \
            pytest.raises(GatewayRequestError) as caught:
        client.complete("Hi")
    assert (caught.value.code, caught.value.kind) == (404, "unknown_request")


def test_deltas_restart_the_timeout(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    def steady(frame: Frame) -> list[Frame]:
        if frame["type"] == "completion":
            return [_delta(frame["id"], "a", [1])]
        if frame["type"] == "ping":
            # each ping (every 0.2 s) brings the next delta; the fifth brings the final
            rid = gateway.of_type("completion")[0]["id"]
            pings = len(gateway.of_type("ping"))
            return [_final(rid, "a" * (pings + 1), [1] * (pings + 1))] if pings >= 5 else [_delta(rid, "a", [1])]
        return []

    gateway = scripted(steady)
    started = time.monotonic()
    with Client(gateway.endpoint, timeout_s=0.5, heartbeat_s=0.2) as client:
        out = client.complete("Hi")
    assert time.monotonic() - started > 0.5  # longer than timeout_s, never silent for that long
    assert out.text == "aaaaaa"


def test_interleaved_streams_each_get_their_own_frames(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    def both(frame: Frame) -> list[Frame]:
        requests = gateway.of_type("completion")
        if frame["type"] != "completion":
            return []
        if len(requests) == 1:
            return [_delta(requests[0]["id"], "a", [1])]
        first, second = requests[0]["id"], requests[1]["id"]
        return [_delta(first, "b", [2]), _delta(second, "x", [9]), _final(second, "x", [9]),
                _final(first, "ab", [1, 2])]

    gateway = scripted(both)
    with Client(gateway.endpoint, timeout_s=5) as client:
        one, two = client.stream("one"), client.stream("two")
        assert next(one).text == "a"  # a stream sends its request at the first next()
        assert [d.text for d in two] == ["x", ""]  # the first stream's frames wait meanwhile
        assert [d.text for d in one] == ["b", ""]
    assert not gateway.of_type("cancel")


def test_a_stream_never_iterated_sends_nothing(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    gateway = scripted(_echo_completion)
    with Client(gateway.endpoint, timeout_s=5) as client:
        client.stream("unused")
        assert client.complete("Hi").text == "Hello"
    assert len(gateway.of_type("completion")) == 1


def test_info_parses_the_info_frame(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    def info(frame: Frame) -> list[Frame]:
        return [{"v": 1, "type": "info", "id": frame["id"], "model": "tiny", "ctx_size": None, "ready": False,
                 "versions": [1], "max_frame_bytes": MAX_FRAME_BYTES, "client_silence_s": 15.0}]

    gateway = scripted(info)
    with Client(gateway.endpoint, timeout_s=5) as client:
        assert client.info() == GatewayInfo("tiny", None, False, (1,), MAX_FRAME_BYTES, 15.0)
    assert gateway.of_type("info")[0] == {"v": 1, "type": "info", "id": gateway.of_type("info")[0]["id"]}


def test_a_frame_that_is_not_json_raises_wire_error(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    gateway = scripted(lambda frame: [{"_raw": b"\xff not json"}] if frame["type"] == "completion" else [])
    with Client(gateway.endpoint, timeout_s=5) as client, pytest.raises(WireError, match="not JSON"):
        client.complete("Hi")
    gateway.handler = lambda frame: [{"_raw": b'{"v": 2, "type": "final"}'}] if frame["type"] == "completion" else []
    with Client(gateway.endpoint, timeout_s=5) as client, pytest.raises(WireError, match="version-1"):
        client.complete("Hi")
    gateway.handler = lambda frame: ([{"v": 1, "type": "final", "id": frame["id"], "text": "x"}]
                                     if frame["type"] == "completion" else [])
    with Client(gateway.endpoint, timeout_s=5) as client, pytest.raises(WireError, match="malformed 'final'"):
        client.complete("Hi")


def test_local_checks_refuse_before_sending(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    gateway = scripted(_echo_completion)
    with Client(gateway.endpoint, timeout_s=5) as client:
        with pytest.raises(RequestError, match="exceeds the request API's limit"):
            client.complete("x" * (MAX_FRAME_BYTES + 1))
        with pytest.raises(RequestError, match="may not set id"):
            client.complete("Hi", id="mine")
        with pytest.raises(RequestError, match="may not set type, v"):
            client.chat([], v=2, type="x")
        with pytest.raises(RequestError, match="stream parameter"):
            client.stream("Hi", stream=False)
        assert client.complete("Hi", stream=False).text == "Hello"
    with pytest.raises(GatewayUnavailable, match="closed"):
        client.complete("Hi")
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(RequestError):
            Client(gateway.endpoint, timeout_s=bad)
        with pytest.raises(RequestError):
            Client(gateway.endpoint, heartbeat_s=bad)


# --- logprobs, n, tokenize and detokenize (docs/PROTOCOL.md §8.3, §8.6) -----------------------------

_LP = [{"token": 1, "logprob": -0.5, "top": [[1, -0.5], [7, -1.5]]}, {"token": 2, "logprob": None, "top": []}]


def _two_choices(frame: Frame) -> list[Frame]:
    """Two choices with logprobs: choice 0 "Hel" + "lo", choice 1 "Yo" (length). Streamed, the deltas
    carry the logprobs and the final frame none; not streamed, each of the final's choices has them."""
    if frame["type"] not in ("completion", "chat"):
        return []
    rid = frame["id"]
    streamed = frame.get("stream") is not False
    choices = [{"index": 0, "text": "Hello", "token_ids": [1, 2], "finish_reason": "stop"},
               {"index": 1, "text": "Yo", "token_ids": [9], "finish_reason": "length"}]
    if not streamed:
        choices = [choices[0] | {"logprobs": _LP}, choices[1] | {"logprobs": _LP[:1]}]
    final = _final(rid, "Hello", [1, 2]) | {
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}, "choices": choices}
    deltas = [_delta(rid, "Hel", [1]) | {"choice": 0, "logprobs": _LP[:1]},
              _delta(rid, "Yo", [9]) | {"choice": 1, "logprobs": _LP[:1]},
              _delta(rid, "lo", [2]) | {"choice": 0, "logprobs": _LP[1:]}]
    return [*deltas, final] if streamed else [final]


@pytest.mark.parametrize("stream", [True, False])
def test_complete_with_choices_and_logprobs(scripted: Callable[[Handler], ScriptedGateway], stream: bool) -> None:
    gateway = scripted(_two_choices)
    with Client(gateway.endpoint, timeout_s=5) as client:
        out = client.complete("Hi", n=2, logprobs=1, presence_penalty=0.5, frequency_penalty=-0.5,
                              logit_bias={5: 2.0, np.int64(7): -100}, stream=stream)
    logprobs = (TokenLogprob(1, -0.5, ((1, -0.5), (7, -1.5))), TokenLogprob(2, float("-inf")))
    assert out.choices == (Choice(0, "Hello", (1, 2), "stop", logprobs), Choice(1, "Yo", (9,), "length", logprobs[:1]))
    assert (out.text, out.token_ids, out.finish_reason, out.logprobs) == ("Hello", (1, 2), "stop", logprobs)
    assert out.usage == Usage(3, 3, 6)
    sent = gateway.of_type("completion")[0]
    assert (sent["n"], sent["logprobs"], sent["presence_penalty"], sent["frequency_penalty"]) == (2, 1, 0.5, -0.5)
    assert sent["logit_bias"] == {"5": 2.0, "7": -100}  # OpenAI's form: token ids as the keys' text


def test_stream_tags_deltas_with_their_choice_and_closes_each_choice(
    scripted: Callable[[Handler], ScriptedGateway],
) -> None:
    gateway = scripted(_two_choices)
    with Client(gateway.endpoint, timeout_s=5) as client:
        deltas = list(client.stream("Hi", n=2, logprobs=1))
    first = (TokenLogprob(1, -0.5, ((1, -0.5), (7, -1.5))),)
    assert deltas == [
        StreamDelta("Hel", (1,), choice=0, logprobs=first), StreamDelta("Yo", (9,), choice=1, logprobs=first),
        StreamDelta("lo", (2,), choice=0, logprobs=(TokenLogprob(2, float("-inf")),)),
        StreamDelta("", (), "stop", None, 0, ()), StreamDelta("", (), "length", Usage(3, 3, 6), 1, ()),
    ]


def test_a_plain_completion_is_one_choice_without_logprobs(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    gateway = scripted(_echo_completion)
    with Client(gateway.endpoint, timeout_s=5) as client:
        out = client.complete("Hi")
        deltas = list(client.stream("Hi"))
    assert out.choices == (Choice(0, "Hello", (1, 2), "stop"),) and out.logprobs is None
    assert [(d.choice, d.logprobs) for d in deltas] == [(0, None)] * 3


@pytest.mark.parametrize("logprobs", [
    [{"token": 1, "logprob": -0.5}],  # no top
    [{"token": -1, "logprob": -0.5, "top": []}],
    [{"token": 1, "logprob": "low", "top": []}],
    [{"token": 1, "logprob": -0.5, "top": [[1]]}],
    "all of them",
])
def test_malformed_logprobs_raise_wire_error(scripted: Callable[[Handler], ScriptedGateway], logprobs: Any) -> None:
    gateway = scripted(lambda frame: [_final(frame["id"], "x", [1]) | {"logprobs": logprobs}]
                       if frame["type"] == "completion" else [])
    with Client(gateway.endpoint, timeout_s=5) as client, pytest.raises(WireError, match="malformed 'final'"):
        client.complete("Hi", logprobs=0)


def test_a_logit_bias_key_that_is_no_token_id_is_refused_before_sending(
    scripted: Callable[[Handler], ScriptedGateway],
) -> None:
    gateway = scripted(_echo_completion)
    with Client(gateway.endpoint, timeout_s=5) as client:
        with pytest.raises(RequestError, match=r"logit_bias: key 1\.5 is not a token id"):
            client.complete("Hi", logit_bias={1.5: 1.0})
        client.complete("Hi", logit_bias={"12": 1.0})  # already OpenAI's form: the gateway checks it
    assert [frame["logit_bias"] for frame in gateway.of_type("completion")] == [{"12": 1.0}]


def _texts(frame: Frame) -> list[Frame]:
    rid = frame.get("id")
    if frame["type"] == "tokenize":
        return [{"v": 1, "type": "tokens", "id": rid, "tokens": [2] * frame["add_special"] + [72, 105]}]
    if frame["type"] == "detokenize":
        if any(token >= 1000 for token in frame["tokens"]):
            return [{"v": 1, "type": "error", "id": rid, "code": 400, "error": "invalid_request",
                     "message": "outside the vocabulary", "param": "tokens"}]
        return [{"v": 1, "type": "text", "id": rid, "content": "".join(map(chr, frame["tokens"]))}]
    return []


def test_tokenize_and_detokenize(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    gateway = scripted(_texts)
    with Client(gateway.endpoint, timeout_s=5) as client:
        assert client.tokenize("Hi") == (72, 105)
        assert client.tokenize("Hi", add_special=True) == (2, 72, 105)
        assert client.detokenize((72, np.int32(105))) == "Hi"
        with pytest.raises(GatewayRequestError) as caught:
            client.detokenize([5000])
    assert (caught.value.code, caught.value.param) == (400, "tokens")
    tokenize = gateway.of_type("tokenize")[0]
    assert tokenize == {"v": 1, "type": "tokenize", "id": tokenize["id"], "content": "Hi", "add_special": False}
    assert gateway.of_type("detokenize")[0]["tokens"] == [72, 105]
    assert not gateway.of_type("cancel")  # every one was answered


@pytest.mark.parametrize("answer", [
    {"type": "tokens", "tokens": ["x"]},
    {"type": "tokens"},
    {"type": "text", "content": 5},
    {"type": "final", "text": "Hi"},  # not the answer to a tokenize
])
def test_a_wrong_answer_to_tokenize_raises_wire_error(
    scripted: Callable[[Handler], ScriptedGateway], answer: Frame,
) -> None:
    gateway = scripted(lambda frame: [{"v": 1, "id": frame["id"], **answer}] if "tokenize" in frame["type"] else [])
    with Client(gateway.endpoint, timeout_s=5) as client, pytest.raises(WireError):
        client.tokenize("Hi") if answer["type"] != "text" else client.detokenize([1])


def test_an_unanswered_tokenize_is_cancelled_when_the_wait_ends(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    gateway = scripted(lambda frame: [])
    with Client(gateway.endpoint, timeout_s=0.3, heartbeat_s=1.0) as client, pytest.raises(GatewayTimeout):
        client.tokenize("Hi")
    cancel = gateway.wait_for("cancel")
    assert cancel["id"] == gateway.of_type("tokenize")[0]["id"]


_FRAME_KEYS = ["v", "type", "id", "text", "token_ids", "finish_reason", "usage", "prompt_tokens", "completion_tokens",
               "choices", "index", "choice", "logprobs", "token", "logprob", "top", "tokens", "content", "data",
               "embedding", "model", "total_tokens"]


@given(hostile_json(_FRAME_KEYS, {"v": st.just(1),
                                  "type": st.sampled_from(["final", "delta", "tokens", "text", "embedding"])}))
@settings(max_examples=300, deadline=None)
def test_any_frame_from_a_gateway_is_a_value_or_a_wire_error(data: bytes) -> None:
    """Whatever a (broken or hostile) gateway sends, the client raises WireError, nothing else."""
    builders = (Completion.from_frame, StreamDelta.from_frame, tokens_from_frame, content_from_frame,
                Embeddings.from_frame)
    try:
        frame = _decode(data, "tcp://gateway")
    except WireError:
        return
    for builder in builders:
        with contextlib.suppress(WireError):
            _parsed(builder, frame, "tcp://gateway")


def test_frames_json_cannot_carry_are_wire_errors() -> None:
    for data in (b'{"v":1,"type":"final","n":' + b"9" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(WireError, match="not JSON"):
            _decode(data, "tcp://gateway")
    frame = _decode(b'{"v":1,"type":"delta","text":"","token_ids":[Infinity]}', "tcp://gateway")
    with pytest.raises(WireError, match="malformed 'delta'"):
        _parsed(StreamDelta.from_frame, frame, "tcp://gateway")


# --- embed (docs/PROTOCOL.md §8.3, §8.6) ------------------------------------------------------------

_VECTORS = np.array([[0.1, -0.2, 0.3], [1 / 3, 0.0, -1e-7]], dtype=np.float32)


def _embedding_entry(index: int, vector: np.ndarray[Any, Any], encoding: str) -> Frame:
    if encoding == "base64":
        return {"index": index, "embedding": base64.b64encode(vector.astype("<f4").tobytes()).decode()}
    return {"index": index, "embedding": [float(str(value)) for value in vector]}  # the gateway's shortest texts


def _embeddings(frame: Frame) -> list[Frame]:
    if frame["type"] != "embed":
        return []
    encoding = frame.get("encoding_format", "float")
    data = [_embedding_entry(index, _VECTORS[index], encoding) for index in range(len(frame["input"]))]
    return [{"v": 1, "type": "embedding", "id": frame["id"], "data": data[::-1], "model": "tiny",  # any order
             "usage": {"prompt_tokens": 4, "total_tokens": 4}}]


def test_embed_sends_an_embed_frame_and_returns_float32_vectors(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    gateway = scripted(_embeddings)
    with Client(gateway.endpoint, timeout_s=5) as client:
        floats = client.embed(["a", [5, np.int64(6)]])
        packed = client.embed(np.array([[1, 2], [3, 4]]), encoding_format="base64", model="tiny", dimensions=3)
    assert floats == packed == Embeddings(tuple(tuple(row.tolist()) for row in _VECTORS), "tiny", Usage(4, 0, 4))
    np.testing.assert_array_equal(np.asarray(floats.vectors, dtype=np.float32), _VECTORS)  # float32s exactly
    first, second = gateway.of_type("embed")
    assert first == {"v": 1, "type": "embed", "id": first["id"], "input": ["a", [5, 6]], "encoding_format": "float"}
    assert (second["input"], second["model"], second["dimensions"]) == ([[1, 2], [3, 4]], "tiny", 3)
    assert not gateway.of_type("cancel")


def test_embed_of_one_text_sends_it_as_a_string(scripted: Callable[[Handler], ScriptedGateway]) -> None:
    gateway = scripted(lambda frame: _embeddings({**frame, "input": ["x"]}))
    with Client(gateway.endpoint, timeout_s=5) as client:
        assert len(client.embed("one text").vectors) == 1
    assert gateway.of_type("embed")[0]["input"] == "one text"


@pytest.mark.parametrize("inputs", [[1.5], [None], [["a"]], 7])
def test_embed_inputs_that_are_no_text_or_token_ids_are_refused_before_sending(
    scripted: Callable[[Handler], ScriptedGateway], inputs: Any,
) -> None:
    gateway = scripted(_embeddings)
    with Client(gateway.endpoint, timeout_s=5) as client, pytest.raises(RequestError, match="embed: input"):
        client.embed(inputs)
    assert gateway.received == []


@pytest.mark.parametrize("data", [
    [],  # no vector
    [{"index": 0, "embedding": [0.1]}, {"index": 0, "embedding": [0.2]}],  # index 0 twice
    [{"index": 1, "embedding": [0.1]}],  # no index 0
    [{"index": 0, "embedding": [0.1]}, {"index": 1, "embedding": [0.1, 0.2]}],  # ragged
    [{"index": 0, "embedding": ["x"]}],
    [{"index": 0, "embedding": [True]}],
    [{"index": 0, "embedding": "not base64!"}],
    [{"index": 0, "embedding": base64.b64encode(b"abc").decode()}],  # not whole float32s
    [{"index": 0}],
    "data",
])
def test_a_malformed_embedding_frame_raises_wire_error(scripted: Callable[[Handler], ScriptedGateway], data: Any) -> None:
    gateway = scripted(lambda frame: [{"v": 1, "type": "embedding", "id": frame["id"], "data": data, "model": "m",
                                       "usage": {"prompt_tokens": 1, "total_tokens": 1}}])
    with Client(gateway.endpoint, timeout_s=5) as client, pytest.raises(WireError):
        client.embed("x")


def test_embed_errors_raise_typed_and_an_unanswered_embed_is_cancelled_after_its_own_timeout(
    scripted: Callable[[Handler], ScriptedGateway],
) -> None:
    def handler(frame: Frame) -> list[Frame]:
        if frame["type"] == "embed" and frame["input"] == "bad":
            return [{**_error(frame["id"], 400, "invalid_request"), "param": "input[1]"}]
        return []

    gateway = scripted(handler)
    with Client(gateway.endpoint, timeout_s=30, heartbeat_s=1.0) as client:
        with pytest.raises(GatewayRequestError) as caught:
            client.embed("bad")
        assert caught.value.param == "input[1]"
        started = time.monotonic()
        with pytest.raises(GatewayTimeout):
            client.embed("slow", timeout_s=0.3)  # this wait's bound, not the client's 30 s
        assert time.monotonic() - started < 5
        with pytest.raises(RequestError, match="timeout_s 0 must be a positive number"):
            client.embed("x", timeout_s=0)
    assert gateway.wait_for("cancel")["id"] == gateway.of_type("embed")[1]["id"]
