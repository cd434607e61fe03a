"""Link emulation's shell: a delay line sends on its socket at the emulated arrival times, pushes back
when full, reports what its socket refuses, and closes within its bound (real sockets, in-process)."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from skippy_zmq.launch.topology import free_tcp_ports
from skippy_zmq.link import LinkShape
from skippy_zmq.stage.delay_line import DelayLine, LineClosed

WAIT_S = 5.0


@pytest.fixture
def context() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.term()


def _pair(context: zmq.Context[Any], endpoint: str, *, hwm: int = 16) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    for socket in (pull, push):
        socket.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, hwm)
    pull.setsockopt(zmq.RCVHWM, hwm)
    pull.bind(endpoint)
    push.connect(endpoint)
    return pull, push


def _unheard_push(context: zmq.Context[Any]) -> zmq.Socket[Any]:
    """A PUSH nobody listens to: it queues one message (its high-water mark) and takes no more."""
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 1)
    push.connect(f"tcp://127.0.0.1:{free_tcp_ports(1)[0]}")
    return push


def test_messages_arrive_after_the_delay_in_order_and_whole(context: zmq.Context[Any]) -> None:
    pull, push = _pair(context, "inproc://line-order")
    line = DelayLine(push, LinkShape(delay_ms=50, jitter_ms=20), wait_ms=1000)
    try:
        line.start()
        handed: list[float] = []
        for index in range(8):
            handed.append(time.monotonic())
            line.put([b"head", index.to_bytes(4, "little"), memoryview(bytes(1000))], lambda: None)
        received = []
        for _ in range(8):
            assert pull.poll(round(WAIT_S * 1000)), "a message did not arrive within 5 s"
            frames = pull.recv_multipart()
            received.append((time.monotonic(), frames))
        assert [int.from_bytes(frames[1], "little") for _, frames in received] == list(range(8))
        assert all(frames[0] == b"head" and frames[2] == bytes(1000) for _, frames in received)
        assert all(at - sent >= 0.050 for (at, _), sent in zip(received, handed, strict=True))
        assert line.close() == LineClosed(delivered=8, dropped=0)
    finally:
        for socket in (pull, push):
            socket.close(linger=0)


def test_a_full_line_pushes_back_for_wait_ms_then_raises_again(context: zmq.Context[Any]) -> None:
    pull, push = _pair(context, "inproc://line-full")
    line = DelayLine(push, LinkShape(delay_ms=5000), wait_ms=100, capacity=2)
    try:
        line.start()
        line.put([b"one"], lambda: None)
        line.put([b"two"], lambda: None)
        started = time.monotonic()
        with pytest.raises(zmq.Again):  # as a send on a socket at its high-water mark
            line.put([b"three"], lambda: None)
        assert 0.09 <= time.monotonic() - started < 1.0
    finally:
        assert line.close(drain_s=0.1) == LineClosed(delivered=0, dropped=2)
        for socket in (pull, push):
            socket.close(linger=0)


def test_what_the_socket_refuses_within_wait_ms_is_settled_in_the_callers_thread(context: zmq.Context[Any]) -> None:
    push = _unheard_push(context)
    refused: list[int] = []
    line = DelayLine(push, LinkShape(delay_ms=1), wait_ms=100)
    try:
        line.start()
        for index in range(3):
            line.put([b"x"], functools.partial(refused.append, index))
        deadline = time.monotonic() + WAIT_S
        while len(refused) < 2:
            assert time.monotonic() < deadline, f"refusals not settled within 5 s: {refused}"
            line.settle()
            time.sleep(0.01)
        assert refused == [1, 2]  # the first went into the socket's queue
    finally:
        closed = line.close(drain_s=0.1)
        push.close(linger=0)
    assert closed == LineClosed(delivered=1, dropped=0)


def test_close_delivers_what_it_can_within_its_bound_and_counts_the_dropped(context: zmq.Context[Any]) -> None:
    pull, push = _pair(context, "inproc://line-close")
    line = DelayLine(push, LinkShape(delay_ms=5000), wait_ms=1000)
    try:
        line.start()
        for _ in range(3):
            line.put([b"late"], lambda: None)
        started = time.monotonic()
        assert line.close(drain_s=0.2) == LineClosed(delivered=0, dropped=3)
        assert time.monotonic() - started < 1.5
        assert not pull.poll(50)
        with pytest.raises(zmq.Again):  # closed: nothing more is taken
            line.put([b"after"], lambda: None)
    finally:
        for socket in (pull, push):
            socket.close(linger=0)


def test_close_cuts_short_a_send_the_socket_keeps_waiting_on(context: zmq.Context[Any]) -> None:
    push = _unheard_push(context)
    refused: list[int] = []
    line = DelayLine(push, LinkShape(delay_ms=1), wait_ms=30_000)
    try:
        line.start()
        line.put([b"queued"], functools.partial(refused.append, 0))  # the socket's one place
        line.put([b"stuck"], functools.partial(refused.append, 1))
        time.sleep(0.1)  # the line's thread now waits on the full socket, for up to 30 s
        started = time.monotonic()
        assert line.close(drain_s=0.2) == LineClosed(delivered=1, dropped=1)
        assert time.monotonic() - started < 1.0
        assert refused == []  # cut short by the close, not refused by the downstream
    finally:
        push.close(linger=0)


def test_close_waits_for_messages_due_within_the_bound(context: zmq.Context[Any]) -> None:
    pull, push = _pair(context, "inproc://line-drain")
    line = DelayLine(push, LinkShape(delay_ms=100), wait_ms=1000)
    try:
        line.start()
        line.put([b"due"], lambda: None)
        assert line.close(drain_s=2.0) == LineClosed(delivered=1, dropped=0)
        assert pull.poll(1000) and pull.recv_multipart() == [b"due"]
    finally:
        for socket in (pull, push):
            socket.close(linger=0)


def test_a_line_never_started_closes_at_once_dropping_what_it_holds(context: zmq.Context[Any]) -> None:
    _pull, push = _pair(context, "inproc://line-unstarted")
    line = DelayLine(push, LinkShape(delay_ms=1), wait_ms=0)
    try:
        line.put([b"x"], lambda: None)
        started = time.monotonic()
        assert line.close() == LineClosed(delivered=0, dropped=1)
        assert time.monotonic() - started < 0.5
    finally:
        for socket in (_pull, push):
            socket.close(linger=0)
