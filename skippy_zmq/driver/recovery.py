"""Socket-free, clock-free recovery of a driver from a failed stage (docs/PROTOCOL.md §6,
Recovery). `Recovery` remembers: which stages are down and since when, which sessions wait to
start over (and the stages that made them), the first request id of each session's current run,
and held errors. `Replayer` acts on its answers over the scheduler's `Lanes`: replays, held
errors, give-ups; and tells the `StageWatch` each of them, for the operator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from skippy_zmq.driver.generation import Generation, GenerationState
from skippy_zmq.driver.lanes import Action, Lanes, Liveness
from skippy_zmq.driver.watch import RecoveryView, StageWatch
from skippy_zmq.errors import RemoteStageError, SkippyError, StageTimeout
from skippy_zmq.wire.replies import ErrorCause, Reply

LANE_RETRY_S = 1.0
"""How long a session a stage refused for lack of a lane waits before it starts over: the lanes
are held by sessions this driver did not open, and free only when their owner stops them or the
stage's TTL runs out (docs/PROTOCOL.md §6, Driver restarts)."""
STARVED_S = 5.0
"""A stage that refused a session for lack of a lane this recently is named by /health."""
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
        self._causes: set[int] = set()  # stage indexes whose failure made them wait
        self._epoch: dict[int, int] = {}  # session id -> first request id of its current run
        self._suspects: dict[int, tuple[SkippyError, float]] = {}  # held errors and since when
        self._lane_waits: dict[int, tuple[float, SkippyError]] = {}  # session: when it starts over, the error
        self._lane_first: dict[int, float] = {}  # session -> its first refusal for lack of a lane
        self._starved: dict[int, float] = {}  # stage index -> its last refusal for lack of a lane

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

    @property
    def held(self) -> Mapping[int, float]:
        """The stages waited for, and since when (a live view)."""
        return self._down

    @property
    def replays_waiting(self) -> int:
        """Sessions waiting to start over."""
        return len(self._replays)

    def waiting(self) -> set[int]:
        """Sessions that await a replay or a verdict on a held error (they have nothing in flight)."""
        return self._replays | set(self._suspects) | set(self._lane_waits)

    def replaying(self, session_id: int) -> bool:
        """True when the session waits to start over."""
        return session_id in self._replays

    def disrupted(self, stages: Iterable[int], now: float, affected: Iterable[int], *, back: bool) -> None:
        """Stages failed (`back`: restarted and already heard); the `affected` sessions start over."""
        if not back:
            for stage in stages:
                self._down.setdefault(stage, now)
        self._causes.update(stages)
        for session_id in affected:
            self._suspects.pop(session_id, None)
            self._lane_waits.pop(session_id, None)
            self._lane_first.pop(session_id, None)
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
            self._causes.discard(stage)
        sessions = sorted(self._replays)
        self._replays.clear()
        return late, sessions

    def take_causes(self) -> list[int]:
        """The stages whose failure made the sessions just replayed wait (forgotten once taken)."""
        causes = sorted(self._causes)
        self._causes.clear()
        return causes

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

    def lane_refused(self, session_id: int, stage: int | None, error: SkippyError, now: float,
                     next_request: int) -> None:
        """A stage (named by /health unless None) refused the session's run: it starts over after
        LANE_RETRY_S, and replies to the requests it sent so far (from request `next_request` on
        they are new) are stale."""
        self._lane_first.setdefault(session_id, now)
        self._lane_waits[session_id] = (now + LANE_RETRY_S, error)
        if stage is not None:
            self._starved[stage] = now
        self._epoch[session_id] = next_request

    def lane_retries(self, now: float, give_up_after_s: float) -> tuple[list[int], list[tuple[int, SkippyError]]]:
        """Sessions refused for lack of a lane whose wait is over: those to start over now, and
        those refused for longer than `give_up_after_s` (to fail with the stage's error); none
        while a stage is down."""
        if self._down:
            return [], []
        retry: list[int] = []
        late: list[tuple[int, SkippyError]] = []
        for session_id, (due, error) in list(self._lane_waits.items()):
            if due <= now:
                del self._lane_waits[session_id]
                if now - self._lane_first[session_id] > give_up_after_s:
                    late.append((session_id, error))
                else:
                    retry.append(session_id)
        return retry, late

    def starved(self, now: float) -> list[int]:
        """Indexes of the stages that refused a session for lack of a lane within STARVED_S."""
        return sorted(stage for stage, when in self._starved.items() if now - when <= STARVED_S)

    def start_run(self, session_id: int, next_request: int) -> None:
        """The session starts over from request `next_request`: replies to earlier ones are stale."""
        self._epoch[session_id] = next_request

    def forget(self, session_id: int) -> None:
        """The session left the scheduler."""
        self._lane_waits.pop(session_id, None)
        self._lane_first.pop(session_id, None)
        self._replays.discard(session_id)
        self._epoch.pop(session_id, None)
        self._suspects.pop(session_id, None)


class Replayer:
    """Recovery carried out on the scheduler's sessions: stages found down or restarted start
    every affected session over once no stage is down, held errors fail their sessions after
    their grace, and sessions fail when a stage does not come back in time (PROTOCOL §6)."""

    def __init__(self, recovery: Recovery, lanes: Lanes, liveness: Liveness, prefill_chunk: int,
                 lane_wait_s: float = float("inf"), new_word: Callable[[], int] = lambda: 0,
                 watch: StageWatch | None = None) -> None:
        """`new_word` draws another driver word when a stage refuses this one as replaced; `watch`
        hears of every failure, replay and give-up."""
        self._recovery = recovery
        self._watch = watch
        self._lane_wait_s = lane_wait_s
        self._new_word = new_word
        self._word_from = 0  # the first request sent under the current driver word
        self._lanes = lanes
        self._liveness = liveness
        self._prefill_chunk = prefill_chunk

    def disrupted(self, stages: Sequence[int], now: float, *, back: bool, step_s: float) -> list[Action]:
        """Stages lost their sessions (restarted: `back`) or went quiet: every session that has
        sent anything starts over once no stage is down (docs/PROTOCOL.md §6, Recovery)."""
        if self._watch is not None and back:  # told with recovery off too: the operator still sees it
            for stage in stages:
                self._watch.restarted(stage, now)
        elif self._watch is not None:
            self._watch.found_down(stages, now)
        if not self._recovery.enabled:
            return []
        lanes = self._lanes
        # While a stage is down no send leaves (`wants`), so a session admitted but not yet sent
        # starts over too; after a restart (already back) only those that sent anything do.
        affected = [s for s in lanes.active.values() if s.running and (not back or s.session_id not in lanes.unopened)]
        for session in affected:
            lanes.pending.drop(session)
            lanes.unopened.discard(session.session_id)
        self._recovery.disrupted(stages, now, [s.session_id for s in affected], back=back)
        actions: list[Action] = []
        # A complete text whose Stop may be lost with the stage: finished now, not at the Stop's
        # deadline, so its lane is free at once (its Stop goes again, best effort).
        for session in [s for s in lanes.active.values() if s.state is GenerationState.STOPPING]:
            lanes.pending.drop(session)
            actions.append(lanes.send(session, session.stop(), block=False))
            session.stopped(now)
            actions += lanes.retire(session)
        return actions + self.recovered(now, step_s)

    def recovered(self, now: float, step_s: float) -> list[Action]:
        """Once no stage is down, each waiting session starts over (Stop, Configure, prefill);
        its first chunk leaves one decode step (`step_s`) from now."""
        actions: list[Action] = []
        replays = self._recovery.take_replays(self._liveness.heard_after, self._lanes.next_request)
        replayed = 0
        for session_id in replays:
            session = self._lanes.active.get(session_id)
            if session is not None and session.running:
                session.next_chunk_at = now + step_s
                actions += [self._lanes.send(session, out) for out in session.replay(self._prefill_chunk)]
                replayed += 1
        causes = self._recovery.take_causes() if replays else []
        if replayed and self._watch is not None:
            self._watch.replayed(causes, replayed, now)
        return actions

    def give_up(self, now: float, step_s: float) -> list[Action]:
        """Sessions waiting for a stage that has not come back within the recovery timeout fail,
        naming it; the stage is no longer waited for (new sessions may try it again)."""
        late, waiting = self._recovery.give_up(now)
        names = ", ".join(self._liveness.labels[stage] for stage in late)
        actions: list[Action] = []
        failed = 0
        for session_id in waiting:
            session = self._lanes.active.get(session_id)
            if session is not None:
                error = StageTimeout(
                    f"session {session_id}: {names} failed and did not come back within "
                    f"{self._recovery.timeout_s:g} s; the session could not be replayed"
                )
                failed += 0 if session.done else 1
                actions += self._lanes.fail(session, error, now)
        if late and self._watch is not None:
            self._watch.gave_up(late, failed, now)
        return actions + (self.recovered(now, step_s) if late else [])

    def tick(self, now: float, step_s: float) -> list[Action]:
        """`give_up`, then the watch's look at every stage with what recovery holds now."""
        actions = self.give_up(now, step_s)
        if self._watch is not None:
            view = RecoveryView(self._recovery.held, self._recovery.replays_waiting, len(self._lanes.active))
            self._watch.observe(now, view)
        return actions

    def remote_error(self, session: Generation, reply: Reply, now: float) -> list[Action]:
        """A stage's error fails its session; with recovery on, only after SUSPECT_GRACE_S
        without news of a restart (which would replay the session instead). A stage without a
        free lane makes the session wait and start over instead (`lane_wait_s` at most)."""
        if self._recovery.replaying(session.session_id):
            return []  # an answer to the lost run: the replay supersedes it
        error = RemoteStageError(reply.error)
        cause = reply.error_cause
        if cause is ErrorCause.DRIVER_REPLACED and reply.request_id >= self._word_from:
            # This process drew an incarnation an earlier one of the same driver had, and the
            # stage saw it replaced (docs/PROTOCOL.md §6, Driver restarts): draw another.
            self._lanes.driver_incarnation = self._new_word()
            self._word_from = self._lanes.next_request
        if cause in (ErrorCause.LANE_LIMIT, ErrorCause.DRIVER_REPLACED) and session.running:
            # Lanes held by sessions this driver did not open free only when their owner stops
            # them or the stage's TTL runs out: wait, start over, never fail at once.
            stage = reply.stage_index if cause is ErrorCause.LANE_LIMIT else None
            self._recovery.lane_refused(session.session_id, stage, error, now, self._lanes.next_request)
            self._lanes.pending.drop(session)
            session.pause()
            return []
        if not self._recovery.enabled or not session.running:
            return self._lanes.fail(session, error, now)
        self._recovery.hold(session.session_id, error, now)
        self._lanes.pending.drop(session)
        return []

    def due(self, now: float, step_s: float) -> list[Action]:
        """Sessions whose held error outlived its grace fail with it; sessions refused for lack
        of a lane start over (Stop, Configure, prefill), or fail after waiting `lane_wait_s`."""
        actions: list[Action] = []
        retry, late = self._recovery.lane_retries(now, self._lane_wait_s)
        for session_id, error in [*self._recovery.due_errors(now), *late]:
            if session_id in self._lanes.active:
                actions += self._lanes.fail(self._lanes.active[session_id], error, now)
        for session_id in retry:
            session = self._lanes.active.get(session_id)
            if session is not None and session.running:
                self._recovery.start_run(session_id, self._lanes.next_request)
                session.next_chunk_at = now + step_s
                actions += [self._lanes.send(session, out) for out in session.replay(self._prefill_chunk, count=False)]
        return actions
