"""Socket-free: the frames the request API holds for each ZeroMQ client, and the one byte budget
they count against (docs/PROTOCOL.md §8.1, "Bounded per client").

Every frame for a client (delta, final, pong, error, info) is offered to that client's `Outbox`
queue first and handed to libzmq from there, in order, as libzmq takes it. libzmq takes at most
`ZMQ_SNDHWM` frames per client (the ROUTER's high-water mark) and does not say when it has
written them to the connection, so the last `ZMQ_SNDHWM + 1` frames it took (its queue plus the
one being written) are counted as still queued. A client whose frames would exceed the budget, or
whose queue made no progress for the stall limit, is cut off: its frames are dropped, now and
later, and the shell cancels its requests.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from typing import Any

import attrs

from skippy_zmq.errors import ConfigError

SEND_BUDGET_BYTES = 8 << 20
"""Bytes of frames one client may have queued at the gateway (8 MiB; a final frame at the default
2,048-token context is about 30 KB)."""
MAX_QUEUED_FRAMES = 16_384
"""Frames one client may have queued, whatever their size (64 full answers to 256-id pings)."""
ZMQ_SNDHWM = 32
"""ZMQ_SNDHWM of the ROUTER: frames libzmq takes for one client before it refuses more (EAGAIN)."""
STALL_S = 15.0
"""A client whose queued frames libzmq took none of for this long is cut off (the client silence)."""
CUT_OFF_REMEMBERED = 4096
"""Cut-off clients remembered (the oldest is forgotten first); a forgotten one is cut off again."""


def _positive(instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ConfigError(f"send budget: {attribute.name} must be positive, got {value!r}")


@attrs.frozen
class SendBudget:
    """What one client may have queued: bytes and frames, and how long its queue may stand still."""

    max_bytes: int = attrs.field(default=SEND_BUDGET_BYTES, validator=_positive)
    max_frames: int = attrs.field(default=MAX_QUEUED_FRAMES, validator=_positive)
    stall_s: float = attrs.field(default=STALL_S, validator=_positive)
    zmq_frames: int = attrs.field(default=ZMQ_SNDHWM, validator=_positive)
    """libzmq's high-water mark per client: the frames counted as queued after libzmq took them."""


class Offer(enum.Enum):
    """What became of a frame offered to a client's queue."""

    QUEUED = "queued"  # it waits in the client's queue: hand it to libzmq
    CUT_OFF = "cut_off"  # it would exceed the budget: the client is cut off now, its frames dropped
    DROPPED = "dropped"  # the client was cut off earlier: nothing is queued for it


@attrs.define(eq=False)
class _Queue:
    """One client's frames not yet taken by libzmq, and the sizes of the last ones it took."""

    since: float  # clock time of the last progress: the queue was empty, or libzmq took a frame
    held: deque[bytes] = attrs.Factory(deque)
    held_bytes: int = 0
    taken: deque[int] = attrs.Factory(deque)
    taken_bytes: int = 0

    @property
    def queued(self) -> int:
        return self.held_bytes + self.taken_bytes


class Outbox:
    """Every client's queue of frames against one `SendBudget` each (see module docstring)."""

    def __init__(self, budget: SendBudget | None = None) -> None:
        self.budget = budget if budget is not None else SendBudget()
        self._queues: dict[bytes, _Queue] = {}
        self._cut_off: OrderedDict[bytes, None] = OrderedDict()
        self.peak_bytes = 0  # the most bytes ever queued for one client (stays within max_bytes)
        self.cut_offs = 0  # clients cut off so far

    def queued(self, identity: bytes) -> int:
        """Bytes counted as queued for the client: held here, plus the last frames libzmq took."""
        queue = self._queues.get(identity)
        return 0 if queue is None else queue.queued

    def is_cut_off(self, identity: bytes) -> bool:
        """Whether the client was cut off (its messages are ignored, nothing is sent to it)."""
        return identity in self._cut_off

    def offer(self, identity: bytes, data: bytes, now: float) -> Offer:
        """Queue one frame for the client, or cut the client off if it would exceed the budget."""
        if identity in self._cut_off:
            return Offer.DROPPED
        queue = self._queues.get(identity)
        if queue is None:
            queue = self._queues[identity] = _Queue(now)
        elif not queue.held:
            queue.since = now  # an empty queue was not standing still
        if queue.queued + len(data) > self.budget.max_bytes or len(queue.held) >= self.budget.max_frames:
            self.cut_off(identity)
            return Offer.CUT_OFF
        queue.held.append(data)
        queue.held_bytes += len(data)
        self.peak_bytes = max(self.peak_bytes, queue.queued)
        return Offer.QUEUED

    def next_frame(self, identity: bytes) -> bytes | None:
        """The client's oldest frame not yet taken by libzmq, or None."""
        queue = self._queues.get(identity)
        return queue.held[0] if queue is not None and queue.held else None

    def took(self, identity: bytes, now: float) -> None:
        """libzmq took the client's oldest frame; it stays counted until `zmq_frames` more are taken."""
        queue = self._queues[identity]
        size = len(queue.held.popleft())
        queue.held_bytes -= size
        queue.taken.append(size)
        queue.taken_bytes += size
        if len(queue.taken) > self.budget.zmq_frames + 1:  # libzmq's queue plus the frame being written
            queue.taken_bytes -= queue.taken.popleft()
        queue.since = now

    def backlogged(self) -> list[bytes]:
        """Clients with frames libzmq has not taken yet (to hand over again soon)."""
        return [identity for identity, queue in self._queues.items() if queue.held]

    def stalled(self, now: float) -> list[bytes]:
        """Clients whose held frames libzmq took none of for longer than the stall limit."""
        return [identity for identity, queue in self._queues.items()
                if queue.held and now - queue.since > self.budget.stall_s]

    def cut_off(self, identity: bytes) -> None:
        """Drop the client's frames and every later one (idempotent)."""
        self._queues.pop(identity, None)
        if identity not in self._cut_off:
            self.cut_offs += 1
        self._cut_off[identity] = None
        self._cut_off.move_to_end(identity)
        while len(self._cut_off) > CUT_OFF_REMEMBERED:
            self._cut_off.popitem(last=False)

    def forget(self, identity: bytes) -> None:
        """The client's connection is gone: drop its frames."""
        self._queues.pop(identity, None)

    def expire(self, now: float) -> None:
        """Forget clients with nothing held and no progress for longer than the stall limit, so idle
        clients cost nothing. What libzmq may still hold for one (at most `zmq_frames` frames, if it
        never read them) is no longer counted; its next frames then wait here, and it stalls."""
        for identity in [identity for identity, queue in self._queues.items()
                         if not queue.held and now - queue.since > self.budget.stall_s]:
            del self._queues[identity]
