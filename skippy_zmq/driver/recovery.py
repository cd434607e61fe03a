"""Socket-free, clock-free bookkeeping of a driver's recovery from a failed stage
(docs/PROTOCOL.md §6, Recovery): which stages are down and since when, which sessions wait to
start over, the first request id of each session's current run, and held errors.

The scheduler asks and acts; this module only remembers and answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from skippy_zmq.errors import SkippyError

SUSPECT_GRACE_S = 2.0
"""How long an error reply waits for news of a stage restart before it fails its session: a
restarted stage answers a lost session's queued messages with errors, and the heartbeat that
announces its restart may travel another connection (docs/PROTOCOL.md §6, Recovery)."""


class Recovery:
    """What a driver remembers while stages fail and sessions replay."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._down: dict[int, float] = {}  # stage index -> when it was found down
        self._replays: set[int] = set()  # session ids waiting to start over
        self._epoch: dict[int, int] = {}  # session id -> first request id of its current run
        self._suspects: dict[int, tuple[SkippyError, float]] = {}  # held errors and since when

    @property
    def enabled(self) -> bool:
        """False when the timeout is 0: failures fail sessions at once."""
        return self.timeout_s > 0

    @property
    def holding(self) -> bool:
        """True while some stage is down: nothing is sent, nothing admitted."""
        return bool(self._down)

    def down(self) -> list[int]:
        """Indexes of the stages waited for."""
        return sorted(self._down)

    def waiting(self) -> set[int]:
        """Sessions that await a replay or a verdict on a held error (they have nothing in flight)."""
        return self._replays | set(self._suspects)

    def replaying(self, session_id: int) -> bool:
        """True when the session waits to start over."""
        return session_id in self._replays

    def disrupted(self, stages: Iterable[int], now: float, affected: Iterable[int], *, back: bool) -> None:
        """Stages failed (`back`: restarted and already heard); the `affected` sessions start over."""
        if not back:
            for stage in stages:
                self._down.setdefault(stage, now)
        for session_id in affected:
            self._suspects.pop(session_id, None)
            self._replays.add(session_id)

    def take_replays(self, heard_after: Callable[[int, float], bool], next_request: int) -> list[int]:
        """Forget the stages heard from since they went down; once none is down, the sessions
        to replay now (their current run starts at request `next_request`)."""
        for stage, since in list(self._down.items()):
            if heard_after(stage, since):
                del self._down[stage]
        if self._down:
            return []
        replays = sorted(self._replays)
        self._replays.clear()
        for session_id in replays:
            self._epoch[session_id] = next_request
        return replays

    def give_up(self, now: float) -> tuple[list[int], list[int]]:
        """Stages down for longer than the timeout (no longer waited for) and the sessions that
        waited for them (to fail); both empty while the timeout has not passed."""
        late = sorted(stage for stage, since in self._down.items() if now - since > self.timeout_s)
        if not late:
            return [], []
        for stage in late:
            del self._down[stage]
        sessions = sorted(self._replays)
        self._replays.clear()
        return late, sessions

    def is_current(self, session_id: int, request_id: int) -> bool:
        """False for a reply to a request sent before the session's latest replay."""
        return request_id >= self._epoch.get(session_id, 0)

    def hold(self, session_id: int, error: SkippyError, now: float) -> None:
        """Hold a stage's error for SUSPECT_GRACE_S: news of a restart turns it into a replay."""
        self._suspects.setdefault(session_id, (error, now))

    def due_errors(self, now: float) -> list[tuple[int, SkippyError]]:
        """Held errors whose grace has passed without a restart: their sessions fail."""
        due = [(sid, error) for sid, (error, since) in self._suspects.items() if now - since >= SUSPECT_GRACE_S]
        for session_id, _ in due:
            del self._suspects[session_id]
        return due

    def forget(self, session_id: int) -> None:
        """The session left the scheduler."""
        self._replays.discard(session_id)
        self._epoch.pop(session_id, None)
        self._suspects.pop(session_id, None)
