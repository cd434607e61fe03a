"""A driver restart end to end (docs/PROTOCOL.md §6, Driver restarts): real stage processes on
127.0.0.1 and a `serve` in front, killed with SIGKILL while its streams hold every lane, then
started again with the same command: it serves within seconds, the same greedy text.

The stages run one kernel thread each. With LocalPipeline's default on a 2-core host (two
threads per stage, stages taking turns) every ggml graph node waits at a barrier for the
stage's other thread, so a busy process elsewhere on the host (another test file, a benchmark)
stretches a 16-token completion of the tiny model from under a second to 10-17 s, before the
kill as after it: the restart bound would measure the host's load, not the restart."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from skippy_zmq.launch.processes import LocalPipeline
from skippy_zmq.launch.topology import free_tcp_ports
from skippy_zmq.wire.messages import MessageKind, StageMessage, StateHeader, encode_message
from skippy_zmq.wire.replies import ReplyKind
from tests.conftest import TINY_GEMMA3_LAYERS
from tests.gateway.test_command import Gateway, serving, stage_sessions, wait_for
from tests.pipeline_helpers import RawPeer, running, write_topology

pytestmark = pytest.mark.slow

LANES = 2
PROMPT = "once upon a time"
RESTART_BUDGET_S = 10.0
CLIENT_TIMEOUT_S = 60.0
"""The HTTP client's patience: past the budget, so a slow completion fails the budget's assertion
with its figure rather than the client with a bare timeout."""


@pytest.fixture
def pipeline(tmp_path: Path, tiny_gemma3_path: Path) -> Iterator[tuple[LocalPipeline, list[str]]]:
    """Two stages of the tiny Gemma 3, two lanes each, one kernel thread each (the module's
    docstring says why), with their metrics endpoints."""
    path = write_topology(tmp_path, tiny_gemma3_path, TINY_GEMMA3_LAYERS, 2, lane_count=LANES, ctx_size=1024)
    ports = free_tcp_ports(2)
    parts = path.read_text().split("[[stages]]")
    for index, port in enumerate(ports):
        parts[index + 1] += f'metrics_bind = "127.0.0.1:{port}"\n\n'
    path.write_text("[[stages]]".join(parts))
    with running(path, threads=1) as local:
        yield local, [f"http://127.0.0.1:{port}/metrics" for port in ports]


def complete(gateway: Gateway, timeout_s: float = CLIENT_TIMEOUT_S) -> str:
    """The greedy completion of PROMPT (16 tokens), within `timeout_s`."""
    return gateway.client(timeout_s=timeout_s).completions.create(
        model="tiny-gemma3", prompt=PROMPT, max_tokens=16, temperature=0,
    ).choices[0].text


def open_stream(gateway: Gateway) -> Any:
    """A long greedy stream, read up to its first chunk: the session is decoding."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 900, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    request = urllib.request.Request(gateway.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=10)
    deadline = time.monotonic() + 10
    while not response.readline().startswith(b"data: {"):
        assert time.monotonic() < deadline, "no stream chunk within 10 s"
    return response


def test_a_serve_killed_mid_stream_and_started_again_serves_within_seconds(
    pipeline: tuple[LocalPipeline, list[str]],
) -> None:
    local, metrics = pipeline
    command = ("--topology", str(local.topology_path), "--prefill-chunk", "4")
    first = Gateway(*command)
    try:
        first.wait_healthy()
        before = complete(first)
        streams = [open_stream(first) for _ in range(LANES)]
        assert stage_sessions(metrics) == [LANES, LANES]  # every lane held, mid-stream
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
        for stream in streams:
            stream.close()
    finally:
        if first.process.poll() is None:
            first.process.kill()
            first.process.wait(10)
    assert stage_sessions(metrics) == [LANES, LANES]  # the dead driver's sessions are still held

    restarted_at = time.monotonic()
    with serving(*command) as second:
        second.wait_healthy()
        after = complete(second)
        elapsed = time.monotonic() - restarted_at
        assert after == before
        assert elapsed < RESTART_BUDGET_S, f"first completion {elapsed:.1f} s after the restart"
        # Each stage freed the dead driver's sessions when the new incarnation's first message came;
        # the one left is `after`'s, which the new driver keeps for its prompt cache (PROTOCOL §6).
        wait_for(lambda: stage_sessions(metrics) == [1, 1], 5, "the stages' lanes free again")
        assert second.stop() == 0


def control(kind: MessageKind, session: int, request: int) -> StageMessage:
    """A control message from a sender that gives no driver word (0): a driver the stages cannot
    tell is gone, so nothing but its Stops or the TTL frees its sessions."""
    return StageMessage(kind=kind, pos_start=0, token_count=0, state=StateHeader.for_kind(kind),
                        request_id=request, session_id=session)


def test_lanes_held_by_another_sender_make_requests_queue_and_health_say_why_never_a_500(
    pipeline: tuple[LocalPipeline, list[str]],
) -> None:
    local, metrics = pipeline
    peer = RawPeer(local)  # holds the return endpoint until serve takes it
    try:
        for session in (1, 2):
            peer.send(0, encode_message(control(MessageKind.CONFIGURE_GENERATION, session, session)))
        assert [peer.reply().kind for _ in range(LANES)] == [ReplyKind.ACK] * LANES
    finally:
        peer.close()
    assert stage_sessions(metrics) == [LANES, LANES]
    outcome: dict[str, Any] = {}

    def request() -> None:
        try:
            outcome["text"] = complete(second, timeout_s=60)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            outcome["error"] = exc

    with serving("--topology", str(local.topology_path), "--prefill-chunk", "4") as second:
        second.wait_healthy()
        waiting = threading.Thread(target=request, daemon=True)
        waiting.start()
        wait_for(lambda: second.get("/health")[0] == 503, 10, "/health naming the stage without a free lane")
        _, body, _ = second.get("/health")
        assert body["status"] == "waiting" and 'stage 0 "stage-0"' in body["message"], body
        assert "has no free lane" in body["message"] and waiting.is_alive()  # queued, not failed
        context: zmq.Context[Any] = zmq.Context()
        push = context.socket(zmq.PUSH)
        try:
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDTIMEO, 5000)
            push.connect(local.topology.stages[0].pull_connect)
            for session in (1, 2):  # the other sender lets go of its lanes
                push.send_multipart(encode_message(control(MessageKind.STOP, session, 10 + session)), copy=False)
        finally:
            push.close(linger=0)
            context.term()
        waiting.join(30)
        assert not waiting.is_alive(), "the queued request did not finish within 30 s of the lanes freeing"
        assert "error" not in outcome, outcome
        assert outcome["text"] and outcome["text"] == complete(second)  # greedy: the same text again
        wait_for(lambda: second.get("/health")[0] == 200, 10, "/health 200 once lanes are free")
        assert second.stop() == 0
