"""Socket-free scheduling of many sessions over one pipeline: admission, decode alignment,
pending requests and their deadlines, reply routing and liveness.

The scheduler owns no socket and reads no clock: every call takes the current time and returns
actions for a transport (`driver.py`, or a long-running gateway) to carry out, and the transport
reports back what happened to each send. Requests may be submitted, cancelled and finished at
any time (docs/PROTOCOL.md §6).
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeAlias

import attrs

from skippy_zmq import defaults
from skippy_zmq.config import TopologyConfig
from skippy_zmq.driver.generation import Generation, GenerationRequest, GenerationState, Outgoing
from skippy_zmq.driver.recovery import Recovery
from skippy_zmq.errors import (
    ConfigError,
    RemoteStageError,
    SkippyError,
    StageRefused,
    StageTimeout,
    TokenizerError,
    WireError,
)
from skippy_zmq.runtime.tokenizer import Tokenizer
from skippy_zmq.telemetry import hop_timings
from skippy_zmq.wire.messages import MessageKind, StageMessage
from skippy_zmq.wire.replies import Reply, ReplyKind

DEFAULT_REPLY_TIMEOUT_S = 120.0
DEFAULT_SILENCE_S = 15.0
"""A stage that sent no heartbeat for this long while a request waits is reported dead."""
MIN_PATIENCE_S = 0.05
"""The shortest wait for the stragglers of a decode step before the ready sessions go on."""
IDLE_POLL_S = 0.05
MAX_POLL_S = 0.25
DEFAULT_RECOVERY_TIMEOUT_S = defaults.RECOVERY_TIMEOUT_S


@attrs.frozen
class PipelineShape:
    """What scheduling needs of a topology: stage names, lanes and context."""

    labels: tuple[str, ...]
    stage_ids: tuple[str, ...]
    max_sessions: int
    ctx_size: int

    @classmethod
    def from_topology(cls, topology: TopologyConfig) -> PipelineShape:
        """Sessions at once: the smallest lane count; positions: the smallest context."""
        stages = topology.stages
        return cls(
            labels=tuple(stage.label for stage in stages),
            stage_ids=tuple(stage.stage_id for stage in stages),
            max_sessions=min(stage.lane_count for stage in stages),
            ctx_size=min(stage.ctx_size for stage in stages),
        )


@attrs.frozen(eq=False)
class Send:
    """Send `message` to stage 0; `block` waits for room (up to the send timeout), otherwise
    the send is best effort and fails at once when stage 0's queue is full."""

    message: StageMessage
    session: Generation
    block: bool = True


@attrs.frozen(eq=False)
class Text:
    """New text of a session, for its stream."""

    session: Generation
    text: str


@attrs.frozen(eq=False)
class Finished:
    """A session became final (finished, failed or cancelled) and left the scheduler."""

    session: Generation


Action: TypeAlias = Send | Text | Finished


@attrs.define
class Pending:
    """A sent message whose reply is awaited."""

    session: Generation
    kind: MessageKind
    request_id: int
    sent_at: float
    deadline: float


class PendingTable:
    """Sent messages awaiting replies, keyed by (request_id, session_id)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[int, int], Pending] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, pending: Pending) -> None:
        """Await a reply to `pending`."""
        self._by_key[(pending.request_id, pending.session.session_id)] = pending

    def pop(self, request_id: int, session_id: int) -> Pending | None:
        """The entry a reply answers, no longer awaited; None for a stale reply."""
        return self._by_key.pop((request_id, session_id), None)

    def drop(self, session: Generation) -> None:
        """Forget every entry of `session`."""
        for key in [k for k, p in self._by_key.items() if p.session is session]:
            del self._by_key[key]

    def sessions(self) -> set[int]:
        """Ids of the sessions awaiting at least one reply."""
        return {p.session.session_id for p in self._by_key.values()}

    def decode_in_flight(self, session_ids: set[int] | None = None) -> bool:
        """True while some decode step (of one of `session_ids`, if given) has not been answered."""
        return any(
            p.kind is MessageKind.DECODE_EMBD and (session_ids is None or p.session.session_id in session_ids)
            for p in self._by_key.values()
        )

    def waited_longer(self, now: float, seconds: float) -> bool:
        """True when some entry has waited longer than `seconds`."""
        return any(now - p.sent_at > seconds for p in self._by_key.values())

    def soonest_deadline(self) -> float | None:
        """The earliest deadline, or None when nothing is awaited."""
        return min((p.deadline for p in self._by_key.values()), default=None)

    def take_overdue(self, now: float, silent_after_s: float | None) -> list[Pending]:
        """Remove and return the entries past their deadline, and, when `silent_after_s` is
        given (some stage is silent), those waiting longer than that."""
        overdue = [
            (key, p) for key, p in self._by_key.items()
            if p.deadline <= now or (silent_after_s is not None and now - p.sent_at > silent_after_s)
        ]
        for key, _ in overdue:
            del self._by_key[key]
        return [p for _, p in overdue]


class Liveness:
    """When each stage was last heard from; any reply counts, heartbeats included."""

    def __init__(self, labels: Sequence[str], silence_s: float) -> None:
        self.labels = tuple(labels)
        self.silence_s = silence_s
        self._heard: dict[int, float] = {}
        self._incarnation: dict[int, int] = {}

    def heard(self, stage_index: int, now: float, incarnation: int = 0) -> bool:
        """Stage `stage_index` sent something at `now`; True when its heartbeat carries a new
        incarnation: the stage is a new process and has lost every session."""
        self._heard[stage_index] = now
        if not incarnation:
            return False
        previous = self._incarnation.get(stage_index)
        self._incarnation[stage_index] = incarnation
        return previous is not None and previous != incarnation

    def heard_after(self, stage_index: int, since: float) -> bool:
        """True when the stage sent something after `since`."""
        return self._heard.get(stage_index, float("-inf")) > since

    def silent_indexes(self, now: float) -> list[int]:
        """Indexes of the stages silent for longer than `silence_s`."""
        return [i for i in range(len(self.labels)) if now - self._heard.get(i, float("-inf")) > self.silence_s]

    def missing_since(self, since: float) -> list[str]:
        """Labels of the stages not heard from at or after `since`."""
        return [label for index, label in enumerate(self.labels) if self._heard.get(index, float("-inf")) < since]

    def silent(self, now: float) -> list[str]:
        """A description of every stage silent for longer than `silence_s`."""
        silent = []
        for index, label in enumerate(self.labels):
            heard = self._heard.get(index)
            if heard is None or now - heard > self.silence_s:
                age = "never" if heard is None else f"{now - heard:.1f} s ago"
                silent.append(f"{label} is silent (last heartbeat {age})")
        return silent


def _random_session_id() -> int:
    return secrets.randbits(63) + 1


class Scheduler:
    """Admits sessions up to the pipeline's lanes, aligns their decode steps, routes replies
    and enforces deadlines; every call returns the actions a transport must carry out."""

    def __init__(
        self,
        shape: PipelineShape,
        tokenizer: Tokenizer,
        *,
        reply_timeout_s: float = DEFAULT_REPLY_TIMEOUT_S,
        silence_s: float = DEFAULT_SILENCE_S,
        prefill_chunk: int = 256,
        micro_batches: int = 1,
        recovery_timeout_s: float = DEFAULT_RECOVERY_TIMEOUT_S,
        new_session_id: Callable[[], int] = _random_session_id,
    ) -> None:
        if prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk {prefill_chunk} must be at least 1")
        if micro_batches < 1:
            raise ConfigError(f"micro_batches {micro_batches} must be at least 1")
        self.shape = shape
        self.reply_timeout_s = reply_timeout_s
        self.silence_s = silence_s
        self.prefill_chunk = prefill_chunk
        self.micro_batches = micro_batches
        # A full stage-0 queue is back-pressure: it drains as stage 0 finishes a message. A send
        # that waits longer than a stage may stay silent means stage 0 is gone.
        self.send_timeout_s = min(reply_timeout_s, silence_s)
        self.liveness = Liveness(shape.labels, silence_s)
        self.step_s = 0.1  # running mean of a decode step's round trip
        self._tokenizer = tokenizer
        self._new_session_id = new_session_id
        self._waiting: deque[Generation] = deque()
        self._active: dict[int, Generation] = {}
        self._unopened: set[int] = set()  # admitted, nothing sent yet
        self._groups: dict[int, int] = {}  # session id -> micro-batch group
        self._owed_stops: dict[int, tuple[Generation, float]] = {}  # refused Stops: session, first refusal
        self._pending = PendingTable()
        self._next_request = 1
        self._submitted = 0
        self._recovery = Recovery(recovery_timeout_s)

    @property
    def waiting(self) -> int:
        """Sessions queued for a lane."""
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Sessions holding a lane."""
        return len(self._active)

    @property
    def down(self) -> list[str]:
        """Labels of the stages that failed and are waited for (sessions replay once they are back)."""
        return [self.shape.labels[i] for i in self._recovery.down()]

    # --- requests in and out ----------------------------------------------------------------

    def submit(self, request: GenerationRequest, *, index: int | None = None) -> Generation:
        """Queue a request (it starts on a later `tick`, once a lane is free). A request that
        cannot run comes back already final. `index` (default: a running count) is how the
        session's text and errors are labelled."""
        index = self._submitted if index is None else index
        self._submitted += 1
        session = Generation.create(index, self._new_session_id(), request, self._tokenizer, self.shape.ctx_size)
        if not session.done:
            self._waiting.append(session)
        return session

    def cancel(self, session: Generation, now: float) -> list[Action]:
        """Give up on a session: leave the queue, or free its lanes on every stage (best effort)."""
        if session.done:
            return []
        actions: list[Action] = []
        if session.running and session.session_id not in self._unopened:
            actions.append(self._send(session, session.stop(), block=False))
        session.cancel(now)
        return actions + self._retire(session)

    def tick(self, now: float) -> list[Action]:
        """Expire deadlines, send the decode steps that are due, admit waiting sessions."""
        actions = self._expire(now)
        actions += self._give_up_recovery(now)
        actions += self._fail_suspects(now)
        actions += self._check_outstanding(now)  # before sending: a send is awaited once sent
        actions += self._resend_stops(now)
        actions += self._flush_decodes(now)
        actions += self._admit(now)
        actions += self._feed_prefills(now)
        return actions

    def poll_timeout(self, now: float) -> float:
        """How long the transport may wait for a reply before the next `tick`."""
        # While a stage is down no chunk leaves, and a session waiting to replay sends nothing.
        waiting = self._recovery.waiting()  # a set union: made once, not per session
        due = [] if self._recovery.holding else [
            s.next_chunk_at for s in self._active.values() if s.has_chunks and s.session_id not in waiting
        ]
        soonest = min([*due, self._pending.soonest_deadline() or float("inf")])
        if soonest == float("inf"):
            return IDLE_POLL_S
        return min(max(soonest - now, 0.0), MAX_POLL_S)

    # --- what the transport reports ---------------------------------------------------------

    def wants(self, send: Send) -> bool:
        """False for a send made pointless by an earlier outcome (its session already ended, or
        a stage went down: its session will replay); a Stop is always worth sending."""
        if send.message.kind is MessageKind.STOP:
            return True
        return not send.session.done and not self._recovery.holding

    def sent(self, send: Send, now: float) -> None:
        """Stage 0 took `send` at `now`: its reply deadline starts."""
        session, message = send.session, send.message
        self._unopened.discard(session.session_id)
        if message.kind is MessageKind.STOP:
            self._owed_stops.pop(session.session_id, None)
        if message.kind.expects_reply and not session.done:
            deadline = now + self.reply_timeout_s
            self._pending.add(Pending(session, message.kind, message.request_id, now, deadline))

    def refused(self, send: Send, now: float) -> list[Action]:
        """Stage 0 did not take `send` in time. A refused Stop only ends a finished session.
        With recovery on, stage 0 is down: sessions wait and replay once it is heard again.
        Otherwise the send fails its session, and when a session was starting, every session
        that has not sent anything yet fails the same way (stage 0 takes nothing)."""
        session, message = send.session, send.message
        if message.kind is MessageKind.STOP:
            # Owed: sent again on later ticks, its lane counted as held until it leaves, so a
            # full stage-0 queue never leaves a lane taken on the stages until their TTL.
            self._owed_stops.setdefault(session.session_id, (session, now))
            if session.state is GenerationState.STOPPING:
                session.stopped(now)  # the text is complete
                return self._retire(session)
            return []
        if self._recovery.enabled:
            return self._disrupted([0], now, back=False)
        error = StageRefused(
            f"session {session.session_id}: {self.shape.labels[0]} did not accept request "
            f"{message.request_id} ({message.kind.name}) within {self.send_timeout_s:g} s"
        )
        actions = self._fail(session, error, now)
        if message.kind is not MessageKind.DECODE_EMBD:
            unopened = [self._active[i] for i in self._unopened]
            for other in [*self._waiting, *unopened]:
                actions += self._fail(other, error, now)
        return actions

    def unsendable(self, send: Send, error: SkippyError, now: float) -> list[Action]:
        """`send` could not even be encoded (a value the wire cannot carry): its session fails
        with `error` and frees whatever lanes it holds."""
        return self._fail(send.session, error, now)

    def on_reply(self, reply: Reply, now: float, received_us: int = 0) -> list[Action]:
        """Route a reply by (request_id, session_id); stale replies are ignored."""
        actions: list[Action] = []
        if self.liveness.heard(reply.stage_index, now, reply.incarnation):
            actions += self._disrupted([reply.stage_index], now, back=True)
        if self._recovery.holding:
            actions += self._recovered(now)
        if reply.is_heartbeat:
            return actions
        pending = self._pending.pop(reply.request_id, reply.session_id)
        if pending is not None:
            return actions + self._answered(pending, reply, now, received_us)
        session = self._active.get(reply.session_id)
        current = session is not None and self._recovery.is_current(session.session_id, reply.request_id)
        if reply.kind is ReplyKind.ERROR and session is not None and current:
            # An error for a message nobody waits on (a non-final prefill chunk): it fails the
            # session now, with the real cause, instead of a later symptom.
            return actions + self._remote_error(session, RemoteStageError(reply.error), now)
        return actions  # stale: a reply to an earlier run, or for a session already ended

    # --- inside -----------------------------------------------------------------------------

    def _answered(self, pending: Pending, reply: Reply, now: float, received_us: int) -> list[Action]:
        session = pending.session
        if reply.kind is ReplyKind.ERROR:
            return self._remote_error(session, RemoteStageError(reply.error), now)
        if reply.kind is ReplyKind.ACK:
            if pending.kind is MessageKind.STOP and not session.running:  # a replay's Stop goes on
                session.stopped(now)
                return self._retire(session)
            return []
        if not session.running:
            return []
        try:
            text = session.accept(int(reply.predicted_token), now, hop_timings(reply.trace, received_us))
        except TokenizerError as exc:  # a token id outside the vocab: the pipeline's fault
            return self._fail(session, exc, now)
        actions: list[Action] = [Text(session, text)] if text else []
        if session.state is GenerationState.STOPPING:
            actions.append(self._send(session, session.stop(), block=False))
        elif pending.kind is MessageKind.DECODE_EMBD:
            self.step_s = 0.8 * self.step_s + 0.2 * (now - pending.sent_at)
        return actions

    def _admit(self, now: float) -> list[Action]:
        actions: list[Action] = []
        while (
            self._waiting and not self._recovery.holding
            and len(self._active) + len(self._owed_stops) < self.shape.max_sessions
        ):
            session = self._waiting.popleft()
            self._active[session.session_id] = session
            self._unopened.add(session.session_id)
            self._groups[session.session_id] = self._least_loaded_group()
            session.next_chunk_at = now + self.step_s  # its first chunk leaves now
            actions += [self._send(session, out) for out in session.start(self.prefill_chunk, now)]
        return actions

    def _flush_decodes(self, now: float) -> list[Action]:
        """The next decode step of every session of a micro-batch group whose token is in, once
        no decode step of that group is in flight: the group then travels the pipeline together
        and every stage runs it as one batch (a batched step costs about what a single one
        does), while the other groups keep the other stages busy (docs/PROTOCOL.md §6)."""
        actions: list[Action] = []
        if self._recovery.holding:
            return []
        for group in range(self.micro_batches):
            members = [
                s for s in self._active.values()
                if self._groups.get(s.session_id) == group and not self._recovery.replaying(s.session_id)
            ]
            ready = [s for s in members if s.next_token is not None]
            if not ready:
                continue
            # Wait for the stragglers of this step, but never much longer than a step takes: a
            # lost reply must not hold every other session until its deadline.
            patience = max(MIN_PATIENCE_S, 3 * self.step_s)
            in_flight = self._pending.decode_in_flight({s.session_id for s in members})
            if in_flight and now - min(s.ready_at for s in ready) < patience:
                continue
            actions += [self._send(s, s.next_decode()) for s in ready]
        return actions

    def _feed_prefills(self, now: float) -> list[Action]:
        """The next prompt chunk of every session still prefilling. While other sessions
        decode, one chunk per session per decode step (`step_s`), so a long prompt's prefill
        shares the stages with the running streams instead of freezing them; otherwise every
        chunk at once (docs/PROTOCOL.md §6)."""
        decoding = any(s.running and s.result.tokens for s in self._active.values())  # past their prefill
        actions: list[Action] = []
        if self._recovery.holding:
            return actions
        for session in self._active.values():
            while session.has_chunks and (not decoding or session.next_chunk_at <= now):
                actions.append(self._send(session, session.next_chunk()))
                session.next_chunk_at = now + self.step_s
                if decoding:
                    break
        return actions

    def _resend_stops(self, now: float) -> list[Action]:
        """Owed Stops go out again (best effort); after `reply_timeout_s` the stages' own TTL
        is left to free the session (stage 0 may be gone for good)."""
        actions: list[Action] = []
        for session_id, (session, since) in list(self._owed_stops.items()):
            if now - since > self.reply_timeout_s:
                del self._owed_stops[session_id]
            elif session_id not in self._active:  # a live session sends its own Stop
                actions.append(self._send(session, session.stop(), block=False))
        return actions

    def _least_loaded_group(self) -> int:
        sizes = [0] * self.micro_batches
        for group in self._groups.values():
            sizes[group] += 1
        return sizes.index(min(sizes))

    def _check_outstanding(self, now: float) -> list[Action]:
        """Fail a running session that awaits nothing and has nothing to send: only a reply of
        an unexpected kind gets it there, and it would otherwise wait forever."""
        busy = self._pending.sessions() | self._unopened | self._recovery.waiting()
        stuck = [
            s for s in self._active.values() if s.next_token is None and not s.has_chunks and s.session_id not in busy
        ]
        actions: list[Action] = []
        for session in stuck:
            error = WireError(
                f"session {session.session_id}: no request outstanding; the pipeline answered out of protocol"
            )
            actions += self._fail(session, error, now)
        return actions

    def _expire(self, now: float) -> list[Action]:
        actions: list[Action] = []
        silent_stages = self.liveness.silent_indexes(now)
        if silent_stages and self._recovery.enabled and self._pending.waited_longer(now, self.silence_s):
            # A stage went quiet while requests wait on it: it is down. Its sessions start over
            # once it is back (a supervisor restarts it), or fail after the recovery timeout.
            actions += self._disrupted(silent_stages, now, back=False)
        silent = self.liveness.silent(now)
        for pending in self._pending.take_overdue(now, self.silence_s if silent else None):
            session = pending.session
            if session.done:
                continue
            if pending.kind is MessageKind.STOP and session.state is GenerationState.STOPPING:
                session.stopped(now)  # the text is complete; a lost Stop Ack is not the user's loss
                actions += self._retire(session)
                continue
            if pending.kind is MessageKind.STOP and session.running:
                continue  # a replay's Stop: what it frees, the stages' TTL frees as well
            detail = "; ".join(silent) if silent else "every stage is sending heartbeats"
            error = StageTimeout(
                f"session {session.session_id}: no reply to request {pending.request_id} ({pending.kind.name}) "
                f"after {now - pending.sent_at:.1f} s; {detail} (pipeline stages: {', '.join(self.shape.stage_ids)})"
            )
            actions += self._fail(session, error, now)
        return actions

    # --- recovery ---------------------------------------------------------------------------

    def _disrupted(self, stages: Sequence[int], now: float, *, back: bool) -> list[Action]:
        """Stages lost their sessions (restarted: `back`) or went quiet: every session that has
        sent anything starts over once no stage is down (docs/PROTOCOL.md §6, Recovery)."""
        if not self._recovery.enabled:
            return []
        # While a stage is down no send leaves (`wants`), so a session admitted but not yet sent
        # starts over too; after a restart (already back) only those that sent anything do.
        affected = [
            s for s in self._active.values() if s.running and (not back or s.session_id not in self._unopened)
        ]
        for session in affected:
            self._pending.drop(session)
            self._unopened.discard(session.session_id)
        self._recovery.disrupted(stages, now, [s.session_id for s in affected], back=back)
        actions: list[Action] = []
        # A complete text whose Stop may be lost with the stage: finished now, not at the Stop's
        # deadline, so its lane is free at once (its Stop goes again, best effort).
        for session in [s for s in self._active.values() if s.state is GenerationState.STOPPING]:
            self._pending.drop(session)
            actions.append(self._send(session, session.stop(), block=False))
            session.stopped(now)
            actions += self._retire(session)
        return actions + self._recovered(now)

    def _recovered(self, now: float) -> list[Action]:
        """Once no stage is down, each waiting session starts over (Stop, Configure, prefill)."""
        actions: list[Action] = []
        for session_id in self._recovery.take_replays(self.liveness.heard_after, self._next_request):
            session = self._active.get(session_id)
            if session is not None and session.running:
                session.next_chunk_at = now + self.step_s
                actions += [self._send(session, out) for out in session.replay(self.prefill_chunk)]
        return actions

    def _give_up_recovery(self, now: float) -> list[Action]:
        """Sessions waiting for a stage that has not come back within the recovery timeout fail,
        naming it; the stage is no longer waited for (new sessions may try it again)."""
        late, waiting = self._recovery.give_up(now)
        names = ", ".join(self.shape.labels[stage] for stage in late)
        actions: list[Action] = []
        for session_id in waiting:
            session = self._active.get(session_id)
            if session is not None:
                error = StageTimeout(
                    f"session {session_id}: {names} failed and did not come back within "
                    f"{self._recovery.timeout_s:g} s; the session could not be replayed"
                )
                actions += self._fail(session, error, now)
        return actions + (self._recovered(now) if late else [])

    def _remote_error(self, session: Generation, error: SkippyError, now: float) -> list[Action]:
        """A stage's error fails its session; with recovery on, only after SUSPECT_GRACE_S
        without news of a restart (which would replay the session instead)."""
        if self._recovery.replaying(session.session_id):
            return []  # an answer to the lost run: the replay supersedes it
        if not self._recovery.enabled or not session.running:
            return self._fail(session, error, now)
        self._recovery.hold(session.session_id, error, now)
        self._pending.drop(session)
        return []

    def _fail_suspects(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for session_id, error in self._recovery.due_errors(now):
            if session_id in self._active:
                actions += self._fail(self._active[session_id], error, now)
        return actions

    def _fail(self, session: Generation, error: SkippyError, now: float) -> list[Action]:
        if session.done:
            return []
        # A session that sent anything holds KV somewhere: free it on every stage still alive
        # (nobody waits for the Ack).
        holds_lane = session.session_id in self._active and session.session_id not in self._unopened
        text = session.fail(error, now)
        actions: list[Action] = [Text(session, text)] if text else []
        if holds_lane:
            actions.append(self._send(session, session.stop(), block=False))
        return actions + self._retire(session)

    def _retire(self, session: Generation) -> list[Action]:
        assert session.done, "only a final session leaves the scheduler"
        if self._active.pop(session.session_id, None) is None and session in self._waiting:
            self._waiting.remove(session)
        self._unopened.discard(session.session_id)
        self._groups.pop(session.session_id, None)
        self._recovery.forget(session.session_id)
        self._pending.drop(session)
        return [Finished(session)]

    def _send(self, session: Generation, out: Outgoing, *, block: bool = True) -> Send:
        request_id = self._next_request
        self._next_request += 1
        return Send(out.message(request_id), session, block)
