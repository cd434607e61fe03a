"""The stage transport with real worker processes: signals, shutdown and the stop flag."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from skippy_zmq.config import TopologyConfig
from skippy_zmq.launch.processes import StageProcess
from skippy_zmq.launch.topology import free_tcp_ports, topology_toml
from skippy_zmq.link import LinkShape
from skippy_zmq.runtime.stage import StageRuntime
from skippy_zmq.stage.core import Forward, Inbound, StageCore
from skippy_zmq.stage.worker import StageWorker, StopRequest
from skippy_zmq.telemetry import EventLog
from skippy_zmq.wire.messages import MessageKind, StageMessage, StateHeader, decode_message, encode_message
from skippy_zmq.wire.replies import Reply, ReplyKind, decode_reply
from tests.conftest import TINY_LLAMA_LAYERS
from tests.pipeline_helpers import write_topology

ROUNDS = 10
WORKERS_PER_ROUND = 4
SIGNAL_PAIRS = [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGINT),
                (signal.SIGTERM, signal.SIGINT), (signal.SIGINT, signal.SIGTERM)]


def test_stop_request_is_a_plain_flag_safe_to_set_twice() -> None:
    stop = StopRequest()
    assert not stop.requested
    stop.set()
    stop.set()
    assert stop.requested


def test_signal_handlers_only_set_the_flag() -> None:
    stop = StopRequest()
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop.install()
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler runs in the main thread between bytecodes
        assert stop.requested
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _one_stage_topology(directory: Path, model: Path, index: int) -> Path:
    text = topology_toml(model=str(model), ranges=[(0, TINY_LLAMA_LAYERS)], topology_id=f"signals-{index}",
                         ports=free_tcp_ports(2), n_layer=TINY_LLAMA_LAYERS, ctx_size=64)
    path = directory / f"topology-{index}.toml"
    path.write_text(text)
    return path


@pytest.mark.slow
def test_two_quick_signals_always_end_in_a_clean_exit(tmp_path: Path, tiny_llama_path: Path) -> None:
    # A handler that takes a lock (threading.Event.set) deadlocks when a second signal lands
    # while the first handler holds it; this sends pairs of signals back to back, many times.
    paths = [_one_stage_topology(tmp_path, tiny_llama_path, i) for i in range(WORKERS_PER_ROUND)]
    exits: list[int] = []
    for round_index in range(ROUNDS):
        processes = [StageProcess(path, "stage-0", None) for path in paths]
        try:
            for process in processes:
                assert process.ready.wait(60), process.describe_exit()
            for offset, process in enumerate(processes):
                first, second = SIGNAL_PAIRS[(round_index + offset) % len(SIGNAL_PAIRS)]
                process.process.send_signal(first)
                process.process.send_signal(second)
            for process in processes:
                try:
                    exits.append(process.process.wait(20))
                except subprocess.TimeoutExpired:
                    exits.append(-999)  # hung: reported below, killed in `finally`
        finally:
            for process in processes:
                if process.exit_code() is None:
                    process.process.kill()
                    process.process.wait(10)
    assert exits == [0] * (ROUNDS * WORKERS_PER_ROUND)


def _prompt(session: int) -> StageMessage:
    kind = MessageKind.PREFILL_FINAL_EMBD
    return StageMessage(kind=kind, pos_start=0, token_count=3, state=StateHeader.for_kind(kind, prompt_token_count=3),
                        request_id=session, session_id=session, tokens=[2, 300 + session, 301])


def test_a_stage_runs_the_pass_its_upstream_sent_as_one_though_its_messages_come_apart(
        tmp_path: Path, tiny_llama_path: Path) -> None:
    """Stage 0 computed two prompts in one pass; the final stage gets the first, then the second
    50 ms later (a wide frame still in transit). PASS_CONTINUES on the first makes the final stage
    wait for the second and run both in one pass, instead of the first alone (docs/PROTOCOL.md §5)."""
    topology = TopologyConfig.from_toml(write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 2))
    first, last = topology.stages
    upstream = StageCore(topology, first, StageRuntime.load(tiny_llama_path, first.layer_start, first.layer_end,
                                                            ctx_size=first.ctx_size), log=EventLog("s0", io.StringIO()))
    inbound = [upstream.accept(encode_message(_prompt(s))) for s in (1, 2)]
    assert all(isinstance(i, Inbound) for i in inbound)
    sent = [o.message for o in upstream.run(inbound) if isinstance(o, Forward)]  # type: ignore[arg-type]
    assert [m.pass_continues for m in sent] == [True, False]

    runtime = StageRuntime.load(tiny_llama_path, last.layer_start, last.layer_end, ctx_size=last.ctx_size)
    passes: list[int] = []  # sessions per pass through the final stage's layers
    one, many = runtime.forward, runtime.forward_many

    def alone(session_id: int, *args: Any) -> np.ndarray:
        passes.append(1)
        return one(session_id, *args)

    def together(session_ids: Sequence[int], *args: Any, **kwargs: Any) -> np.ndarray:
        passes.append(len(session_ids))
        return many(session_ids, *args, **kwargs)

    runtime.forward, runtime.forward_many = alone, together  # type: ignore[method-assign]
    # A bound far above the gap, so that only a missing wait can split the pass.
    worker = StageWorker(topology, last, runtime, log=EventLog("s1", io.StringIO()), heartbeat_s=0.2,
                         rest_of_pass_max_s=10.0)
    context: zmq.Context[Any] = zmq.Context()
    replies, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    thread = threading.Thread(target=worker.serve, kwargs={"max_seconds": 60}, daemon=True)
    try:
        replies.bind(topology.driver.return_bind)
        worker.bind()
        thread.start()
        push.connect(last.pull_connect)
        push.send_multipart(encode_message(sent[0]))
        time.sleep(0.05)
        push.send_multipart(encode_message(sent[1]))
        tokens: dict[int, int] = {}
        deadline = time.monotonic() + 30
        while len(tokens) < 2:
            assert replies.poll(max(1, round((deadline - time.monotonic()) * 1000))), "no token reply within 30 s"
            reply = decode_reply(replies.recv_multipart())
            if reply.kind is ReplyKind.PREDICTED_TOKEN:
                tokens[reply.session_id] = reply.predicted_token
        assert passes == [2]
    finally:
        worker.stop()
        thread.join(10)
        for socket in (replies, push):
            socket.close(linger=0)
        context.term()


def _serving(worker: StageWorker) -> threading.Thread:
    thread = threading.Thread(target=worker.serve, kwargs={"max_seconds": 60}, daemon=True)
    worker.bind()
    thread.start()
    return thread


def _events(log: io.StringIO, event: str) -> list[dict[str, Any]]:
    return [record for line in log.getvalue().splitlines() if (record := json.loads(line))["event"] == event]


def test_an_emulated_link_delivers_each_forward_after_its_delay_and_in_order(
        tmp_path: Path, tiny_llama_path: Path) -> None:
    topology = TopologyConfig.from_toml(write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 2))
    first, second = topology.stages
    runtime = StageRuntime.load(tiny_llama_path, first.layer_start, first.layer_end, ctx_size=first.ctx_size)
    log = io.StringIO()
    worker = StageWorker(topology, first, runtime, log=EventLog("s0", log), heartbeat_s=0.2,
                         link=LinkShape.parse("delay=50ms,jitter=30ms"))
    handed: dict[int, float] = {}  # session -> when the worker handed its forward over
    forward = worker._forward

    def timed(outcome: Forward) -> None:
        handed[outcome.message.session_id] = time.monotonic()
        forward(outcome)

    worker._forward = timed  # type: ignore[method-assign]
    context: zmq.Context[Any] = zmq.Context()
    downstream, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    thread: threading.Thread | None = None
    try:
        downstream.bind(second.pull_bind)
        thread = _serving(worker)
        push.connect(first.pull_connect)
        arrived: list[tuple[int, float]] = []
        deadline = time.monotonic() + 30
        # the first prompt alone, so that the link's connection is up before the ones measured
        for sessions in ([1], [2, 3, 4, 5, 6, 7]):
            for session in sessions:
                push.send_multipart(encode_message(_prompt(session)))
            for _ in sessions:
                assert downstream.poll(max(1, round((deadline - time.monotonic()) * 1000))), "no forward within 30 s"
                message = decode_message(downstream.recv_multipart())
                arrived.append((message.session_id, time.monotonic()))
        assert [session for session, _ in arrived] == list(handed) == list(range(1, 8))  # a TCP link never reorders
        assert all(at - handed[session] >= 0.050 for session, at in arrived), (arrived, handed)
    finally:
        worker.stop()
        if thread is not None:
            thread.join(10)
        for socket in (downstream, push):
            socket.close(linger=0)
        context.term()
    assert thread is not None and not thread.is_alive()
    (ready,) = _events(log, "ready")
    assert ready["link"] == "delay=50ms,jitter=30ms"
    assert [(e["delivered"], e["dropped"]) for e in _events(log, "link_stopped")] == [(7, 0)]


def test_the_final_stage_delays_its_replies_but_not_its_heartbeats(tmp_path: Path, tiny_llama_path: Path) -> None:
    topology = TopologyConfig.from_toml(write_topology(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 1))
    (stage,) = topology.stages
    runtime = StageRuntime.load(tiny_llama_path, 0, TINY_LLAMA_LAYERS, ctx_size=stage.ctx_size)
    log = io.StringIO()
    worker = StageWorker(topology, stage, runtime, log=EventLog("s0", log), heartbeat_s=0.1,
                         link=LinkShape.parse("delay=600ms"))
    replied: list[float] = []
    reply = worker._reply

    def timed(answer: Reply) -> None:
        replied.append(time.monotonic())
        reply(answer)

    worker._reply = timed  # type: ignore[method-assign]
    context: zmq.Context[Any] = zmq.Context()
    replies, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    thread: threading.Thread | None = None
    try:
        replies.bind(topology.driver.return_bind)
        thread = _serving(worker)
        push.connect(stage.pull_connect)
        push.send_multipart(encode_message(_prompt(1)))
        beat_lags: list[float] = []  # seconds from a beat's stamp to its arrival
        token_at = None
        deadline = time.monotonic() + 30
        while token_at is None:
            assert replies.poll(max(1, round((deadline - time.monotonic()) * 1000))), "no token within 30 s"
            answer = decode_reply(replies.recv_multipart())
            if answer.is_heartbeat:
                beat_lags.append(time.time() - answer.trace[0].sent_at_us / 1e6)
            elif answer.kind is ReplyKind.PREDICTED_TOKEN:
                token_at = time.monotonic()
        assert token_at - replied[0] >= 0.6
        assert len(beat_lags) >= 3 and max(beat_lags) < 0.3  # the liveness channel is never delayed
    finally:
        worker.stop()
        if thread is not None:
            thread.join(10)
        for socket in (replies, push):
            socket.close(linger=0)
        context.term()
