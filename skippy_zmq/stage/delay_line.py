"""Link emulation's shell: a thread that owns one PUSH socket and sends each message handed to it at
the time its emulated link delivers it (`skippy_zmq.link.LinkClock`; docs/ARCHITECTURE.md, "Link
emulation"). The worker uses one only when its stage's link is emulated.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import zmq

from skippy_zmq.link import LinkClock, LinkShape

if TYPE_CHECKING:
    from skippy_zmq.wire.codecs import Buffer

LINE_CAPACITY = 64
"""Messages one emulated link holds in flight; past that `put` waits, as a send on a full socket does."""
DRAIN_S = 2.0
"""How long a closing line goes on delivering at their times the messages it holds; the rest are dropped."""
POLL_SLICE_MS = 50
"""Longest single wait of the line's thread on a full socket, so that `close` is seen promptly."""


@attrs.frozen
class _Held:
    """One message on the emulated link: when it arrives, its frames, and what to do if the socket refuses it."""

    release: float
    frames: Sequence[Buffer]
    on_refused: Callable[[], None]


@attrs.frozen
class LineClosed:
    """What a closed line did: messages its socket took, and messages still on the link, dropped."""

    delivered: int
    dropped: int


class DelayLine:
    """An emulated link in front of `socket`: `put` (the serve loop) hands it a message, its thread
    sends it when it arrives. A message the socket does not take within `wait_ms` is refused: its
    `on_refused` is called from the serve loop's thread by `settle`."""

    def __init__(self, socket: zmq.Socket[Any], shape: LinkShape, *, wait_ms: int, seed: int = 0,
                 capacity: int = LINE_CAPACITY, name: str = "delay-line") -> None:
        """`socket` is the line's from `start` until `close` returns; nothing else may use it meanwhile."""
        self.shape = shape
        self._socket = socket
        self._wait_ms = wait_ms
        self._capacity = capacity
        self._clock = LinkClock(shape, epoch=time.monotonic(), seed=seed)
        self._held: deque[_Held] = deque()
        self._changed = threading.Condition()
        self._refused: deque[Callable[[], None]] = deque()  # appended by the line's thread, run by `settle`
        self._closing = False
        self._drop_at = math.inf  # set by `close`: what is still held then is dropped
        self._delivered = 0
        self._dropped = 0  # taken off the line for sending when closing cut the send short
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread that owns the socket."""
        self._thread.start()

    def put(self, frames: Sequence[Buffer], on_refused: Callable[[], None]) -> None:
        """Hand one encoded message (its frames, not copied) to the link; zmq.Again when the line stays
        full for `wait_ms`, or is closed, as a send on a full socket raises."""
        deadline = time.monotonic() + self._wait_ms / 1000
        with self._changed:
            while len(self._held) >= self._capacity or self._closing:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closing:
                    raise zmq.Again()
                self._changed.wait(remaining)
            size = sum(memoryview(frame).nbytes for frame in frames)
            self._held.append(_Held(self._clock.arrival(size, time.monotonic()), frames, on_refused))
            self._changed.notify_all()

    def settle(self) -> None:
        """Run `on_refused` of each message the socket refused since the last call (in the caller's thread)."""
        while self._refused:
            self._refused.popleft()()

    def close(self, drain_s: float = DRAIN_S) -> LineClosed:
        """Deliver what the line holds at its times for at most `drain_s`, drop the rest, end the thread
        and settle; the socket is the caller's again."""
        with self._changed:
            self._closing = True
            self._drop_at = time.monotonic() + drain_s
            self._changed.notify_all()
        if self._thread.ident is not None:
            self._thread.join(drain_s + 1)  # its waits all end by `_drop_at`
        with self._changed:
            dropped = len(self._held) + self._dropped
            self._held.clear()
        self.settle()
        return LineClosed(delivered=self._delivered, dropped=dropped)

    def _run(self) -> None:
        while (held := self._next()) is not None:
            sent = self._send(held.frames)
            if sent:
                self._delivered += 1
            elif time.monotonic() >= self._drop_at:
                self._dropped += 1  # closing: not the downstream's failure
            else:
                self._refused.append(held.on_refused)

    def _send(self, frames: Sequence[Buffer]) -> bool:
        """Send once the socket takes a message, within `wait_ms` and before `_drop_at`; False if it did not."""
        until = min(time.monotonic() + self._wait_ms / 1000, self._drop_at)
        while True:
            # in slices: `close` may set `_drop_at` while the socket stays full
            slice_ms = max(0, min(POLL_SLICE_MS, math.ceil((until - time.monotonic()) * 1000)))
            if self._socket.poll(slice_ms, zmq.POLLOUT):
                with contextlib.suppress(zmq.Again):  # one sender: a socket that polls writable takes it whole
                    self._socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    return True
            until = min(until, self._drop_at)
            if time.monotonic() >= until:
                return False

    def _next(self) -> _Held | None:
        """The first message held, once it has arrived; None once closed and empty, or past `_drop_at`."""
        with self._changed:
            while True:
                now = time.monotonic()
                if now >= self._drop_at or (self._closing and not self._held):
                    return None
                if self._held and self._held[0].release <= now:
                    held = self._held.popleft()
                    self._changed.notify_all()  # room for a waiting `put`
                    return held
                until = self._held[0].release if self._held else math.inf
                self._changed.wait(None if math.isinf(until) and math.isinf(self._drop_at)
                                   else min(until, self._drop_at) - now)
