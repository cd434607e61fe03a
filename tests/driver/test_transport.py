"""The driver's transport over real sockets on 127.0.0.1: how it takes the stages' replies."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from skippy_zmq.config import TopologyConfig
from skippy_zmq.driver.lanes import Action
from skippy_zmq.driver.transport import PipelineTransport
from skippy_zmq.tokens.tokenizer import Tokenizer
from skippy_zmq.wire.messages import MessageKind
from skippy_zmq.wire.replies import Reply, ReplyKind, encode_reply
from tests.conftest import TINY_LLAMA_LAYERS
from tests.pipeline_helpers import write_topology


def _token(session: int, *, more: bool) -> Reply:
    return Reply(kind=ReplyKind.PREDICTED_TOKEN, request_id=session, session_id=session, stage_index=0,
                 answered=MessageKind.DECODE_EMBD, predicted_token=5, pass_continues=more)


def test_receive_waits_for_the_rest_of_a_pass_s_replies(tmp_path: Path, tiny_llama_path: Path) -> None:
    """The final stage marked the first of a pass's two tokens PASS_CONTINUES; the second comes
    200 ms later. `receive` hands both to the scheduler before it returns, so the next decode step
    carries both sessions (docs/PROTOCOL.md §6)."""
    topology = TopologyConfig.from_toml(write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 1))
    context: zmq.Context[Any] = zmq.Context()
    first = context.socket(zmq.PUSH)
    seen: list[tuple[int, bool]] = []

    def send_the_last() -> None:
        late = context.socket(zmq.PUSH)  # a socket of this thread's own
        try:
            late.connect(topology.driver.return_connect)
            late.send_multipart(encode_reply(_token(2, more=False)))
        finally:
            late.close(linger=2000)

    def record(reply: Reply, _now: float, _received_us: int = 0) -> list[Action]:
        seen.append((reply.session_id, reply.pass_continues))
        return []

    try:
        with PipelineTransport(topology, Tokenizer.from_gguf(tiny_llama_path)) as transport:
            transport.rest_of_pass_max_s = 10.0  # far above the gap: only a missing wait can split them
            transport.scheduler.on_reply = record  # type: ignore[method-assign]
            first.connect(topology.driver.return_connect)
            first.send_multipart(encode_reply(_token(1, more=True)))
            later = threading.Timer(0.2, send_the_last)
            later.start()
            transport.receive(5.0, None)
            later.join(5)
        assert seen == [(1, True), (2, False)]
    finally:
        first.close(linger=0)
        context.term()


def _link_news(transport: PipelineTransport, until: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Read the stage-0 link's monitor until `until()` holds (within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        monitor = transport.link_monitor
        assert monitor is not None
        if monitor.poll(50):
            transport.read_link(time.monotonic())


def _bind(socket: zmq.Socket[Any], endpoint: str, timeout_s: float = 5.0) -> None:
    """Bind, again while the port a closed socket held is still being let go (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.bind(endpoint)
            return
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_the_link_to_stage_0_is_watched_nothing_listening_then_up_down_and_up(
    tmp_path: Path, tiny_llama_path: Path,
) -> None:
    topology = TopologyConfig.from_toml(write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 1))
    stage = topology.stages[0]
    context: zmq.Context[Any] = zmq.Context()
    said: list[str] = []
    try:
        with PipelineTransport(topology, Tokenizer.from_gguf(tiny_llama_path), watch_link=True) as transport:
            watch = transport.scheduler.watch

            def detail() -> str:
                said.extend(event.event for event in watch.take_events())
                return watch.statuses()[0].detail

            def dropped(times: int) -> Callable[[], bool]:
                return lambda: detail() != "" and said.count("link_down") == times

            _link_news(transport, lambda: "nothing accepts connections" in detail(), "refused at startup")
            assert detail() == (f"never heard: nothing accepts connections at {stage.pull_connect}: check the "
                                "stage is running (it listens once its layers are loaded)")
            for times in (1, 2):
                pull = context.socket(zmq.PULL)
                try:
                    _bind(pull, stage.pull_bind)
                    _link_news(transport, lambda: detail().startswith("never heard: check"), "the handshake")
                finally:
                    pull.close(linger=0)
                _link_news(transport, dropped(times), "the drop")
            assert said == ["link_down", "link_up", "link_down"]  # startup's refusals are no line of their own
            assert watch.statuses()[0].link_downs == 2
    finally:
        context.term()


def test_a_stage_0_with_another_key_fails_the_handshake_and_is_named(tmp_path: Path, tiny_llama_path: Path) -> None:
    topology = TopologyConfig.from_toml(write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 1, curve=True))
    context: zmq.Context[Any] = zmq.Context()
    impostor = context.socket(zmq.PULL)  # stage 0's endpoint, but not stage 0's key pair
    public, secret = zmq.curve_keypair()
    impostor.curve_server, impostor.curve_publickey, impostor.curve_secretkey = True, public, secret
    try:
        impostor.bind(topology.stages[0].pull_bind)
        with PipelineTransport(topology, Tokenizer.from_gguf(tiny_llama_path), watch_link=True) as transport:
            watch = transport.scheduler.watch
            _link_news(transport, lambda: dict(watch.statuses()[0].handshakes_failed).get("key", 0) >= 2, "key")
            [failed] = watch.take_events()
            key_file = tmp_path / "keys" / "public" / "stage-0.key"
            assert (failed.event, failed.fields()["cause"]) == ("handshake_failed", "key")
            assert failed.message == (f'the driver\'s handshake with stage 0 "stage-0" at 127.0.0.1 '
                                      f"({topology.stages[0].pull_connect}) failed: the stage hung up on the CURVE handshake: most "
                                      f"likely its public key is not {key_file} "
                                      "(the stage runs another key pair, or the file is stale)")
            assert f"never heard: the stage hung up on the CURVE handshake: most likely its public key is not " \
                   f"{key_file}" in watch.statuses()[0].detail
    finally:
        impostor.close(linger=0)
        context.term()


def test_curve_at_one_end_of_the_link_only_is_named(tmp_path: Path, tiny_llama_path: Path) -> None:
    topology = TopologyConfig.from_toml(write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 1))
    context: zmq.Context[Any] = zmq.Context()
    curve_stage = context.socket(zmq.PULL)  # CURVE on at stage 0, off in the driver's topology
    public, secret = zmq.curve_keypair()
    curve_stage.curve_server, curve_stage.curve_publickey, curve_stage.curve_secretkey = True, public, secret
    try:
        curve_stage.bind(topology.stages[0].pull_bind)
        with PipelineTransport(topology, Tokenizer.from_gguf(tiny_llama_path), watch_link=True) as transport:
            watch = transport.scheduler.watch
            _link_news(transport, lambda: "mechanism" in dict(watch.statuses()[0].handshakes_failed), "mismatch")
            [failed] = watch.take_events()
            assert (failed.event, failed.fields()["cause"]) == ("handshake_failed", "mechanism")
            assert failed.message.endswith("failed: CURVE is on at one end only ([security] curve = true in the "
                                           "stage's topology): both topologies must agree")
    finally:
        curve_stage.close(linger=0)
        context.term()
