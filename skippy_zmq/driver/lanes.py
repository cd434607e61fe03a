"""The scheduler's table of sessions and what it asks a transport to do: sessions waiting for a
lane and holding one, micro-batch groups, owed Stops, the replies awaited, request ids; the
actions `Send`, `Text`, `Progress` and `Finished`. Socket-free and clock-free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import TypeAlias

import attrs

from skippy_zmq.driver.generation import Generation, GenerationState, Outgoing, draft_offer
from skippy_zmq.driver.speculation import PassCost, allocate, batch_share
from skippy_zmq.errors import SkippyError, WireError
from skippy_zmq.wire.messages import MessageKind, StageMessage
from skippy_zmq.wire.replies import Reply


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


@attrs.frozen(eq=False)
class Progress:
    """How far a session's prompt has run through every stage (docs/PROTOCOL.md §6, Prompt progress), for a
    request that asked: `processed` prompt positions the stages hold, `time_ms` since the session started."""

    session: Generation
    processed: int
    time_ms: float


def progress_report(session: Generation, processed: int, now: float) -> list[Progress]:
    """A Progress report of `processed` prompt positions when it is news (§6, Prompt progress): the request
    asked, its first prompt still runs (a replay's chunks are not news) and it got further than the last report."""
    result = session.result
    if not session.request.progress or result.tokens or not session.progress_reported < processed <= len(
            result.prompt_ids):
        return []
    session.progress_reported = processed
    return [Progress(session, processed, round((now - result.started_s) * 1000, 3))]


def chunk_progress(session: Generation, reply: Reply, now: float) -> list[Progress]:
    """The report an Ack of a prompt chunk makes (the positions the session holds after it, in its token field),
    while the session runs; nothing for an Ack of another kind."""
    if reply.answered is not MessageKind.PREFILL_EMBD or not session.running:
        return []
    return progress_report(session, reply.predicted_token, now)


Report: TypeAlias = Text | Progress | Finished
"""What the scheduler tells a request's owner (the engine's events come from these)."""
Action: TypeAlias = Send | Report


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
            p.kind.decodes and (session_ids is None or p.session.session_id in session_ids)
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

    def last_heard(self, stage_index: int) -> float | None:
        """When the stage last sent anything (None: never)."""
        return self._heard.get(stage_index)

    def incarnation(self, stage_index: int) -> int:
        """The incarnation its latest heartbeat carried (0: none yet)."""
        return self._incarnation.get(stage_index, 0)

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


class Lanes:
    """The sessions a scheduler holds: waiting for a lane (in order), active by session id (and
    which of them have sent nothing yet), each active session's micro-batch group, Stops still
    owed by sessions that left, the replies awaited, and the next request id."""

    def __init__(self, micro_batches: int, *, on_retire: Callable[[int], None], driver_incarnation: int = 0) -> None:
        """`on_retire` hears the id of every session that leaves (recovery forgets it);
        `driver_incarnation` is the word every message carries (docs/PROTOCOL.md §6)."""
        self.micro_batches = micro_batches
        self.driver_incarnation = driver_incarnation
        self.waiting: deque[Generation] = deque()
        self.active: dict[int, Generation] = {}
        self.unopened: set[int] = set()  # admitted, nothing sent yet
        self.groups: dict[int, int] = {}  # session id -> micro-batch group
        self.owed_stops: dict[int, tuple[Generation, float]] = {}  # refused Stops: session, first refusal
        self.pending = PendingTable()
        self.pass_cost = PassCost()  # a decode pass's time per row, for the drafts' allocation
        self.next_request = 1
        self.group_due_at = float("inf")  # when a micro-batch group held back by the spacing may step
        self._group_sent_at = -float("inf")  # when the last micro-batch group stepped
        self._on_retire = on_retire

    @property
    def held(self) -> int:
        """Lanes counted as taken on the stages: active sessions, Stops still owed, and the choices
        that wait to fork an active session's prompt (docs/PROTOCOL.md §6, Choices)."""
        forks = sum(1 for s in self.active.values() for f in s.forks if f.state is GenerationState.WAITING)
        return len(self.active) + len(self.owed_stops) + forks

    def open(self, session: Generation) -> None:
        """`session` takes a lane, in the least loaded micro-batch group."""
        sizes = [0] * self.micro_batches
        for group in self.groups.values():
            sizes[group] += 1
        self.active[session.session_id] = session
        self.unopened.add(session.session_id)
        self.groups[session.session_id] = sizes.index(min(sizes))

    def fork_choices(self, session: Generation, now: float) -> list[Action]:
        """The first choice's prompt is in every stage's cache: the request's other choices copy it
        now, before that choice's Stop or next step can free or move it (docs/PROTOCOL.md §6, Choices)."""
        actions: list[Action] = []
        for fork in session.forks:
            if fork.state is GenerationState.WAITING:
                self.open(fork)
                actions += [self.send(fork, out) for out in fork.fork(now)]
        return actions

    def send(self, session: Generation, out: Outgoing, *, block: bool = True) -> Send:
        """`out` as a message with the next request id."""
        request_id = self.next_request
        self.next_request += 1
        return Send(out.message(request_id, self.driver_incarnation), session, block)

    def fail(self, session: Generation, error: SkippyError, now: float) -> list[Action]:
        """End `session` with `error`; a session that sent anything also sends a best-effort Stop."""
        if session.done:
            return []
        # A session that sent anything holds KV somewhere: free it on every stage still alive
        # (nobody waits for the Ack).
        holds_lane = session.session_id in self.active and session.session_id not in self.unopened
        text = session.fail(error, now)
        actions: list[Action] = [Text(session, text)] if text else []
        if holds_lane:
            actions.append(self.send(session, session.stop(), block=False))
        return actions + self.retire(session)

    def fail_stuck(self, now: float, *, busy: set[int]) -> list[Action]:
        """Fail the running sessions that await no reply (not in `busy`, nor unopened) and have
        nothing to send: only a reply of an unexpected kind gets one there."""
        stuck = [s for s in self.active.values()
                 if s.next_token is None and not s.has_chunks and s.session_id not in busy | self.unopened]
        actions: list[Action] = []
        for session in stuck:
            error = WireError(f"session {session.session_id}: no request outstanding; the pipeline answered out "
                              "of protocol")
            actions += self.fail(session, error, now)
        return actions

    def retire(self, session: Generation) -> list[Action]:
        """A final session leaves every table; choices still waiting to fork its prompt end with it."""
        assert session.done, "only a final session leaves the scheduler"
        orphans = [fork for fork in session.forks if fork.state is GenerationState.WAITING]
        for fork in orphans:
            when = session.result.finished_s
            if session.error is not None:
                fork.fail(session.error, when)
            elif session.state is GenerationState.CANCELLED:
                fork.cancel(when)
            else:  # the first choice finished: its prompt was forked before it could
                fork.fail(WireError(f"session {fork.session_id}: choice {fork.choice} was never forked"), when)
        if self.active.pop(session.session_id, None) is None and session in self.waiting:
            self.waiting.remove(session)
        self.unopened.discard(session.session_id)
        self.groups.pop(session.session_id, None)
        self._on_retire(session.session_id)
        self.pending.drop(session)
        return [Finished(session), *(Finished(fork) for fork in orphans)]

    def decode_steps(self, now: float, patience: float, *, replaying: Callable[[int], bool],
                     spacing: float = 0.0) -> list[Action]:
        """The next decode step of every session of a micro-batch group whose token is in, once
        no decode step of that group is in flight or the first ready one has waited `patience`:
        the group then travels the pipeline together and every stage runs it as one batch (a
        batched step costs about what a single one does), while the other groups keep the other
        stages busy (docs/PROTOCOL.md §6). Sessions that wait to replay are left out.

        Groups step at least `spacing` apart (`group_due_at` says when the next may): groups whose
        tokens came in together (a wave's prefill, or one pass that took every group) would
        otherwise reach the first stage together and run as one pass there, and then stay one."""
        actions: list[Action] = []
        self.group_due_at = float("inf")
        # Drafts share a pass's rows with the other sessions' steps and prompts: fewer each as more sessions hold a
        # lane, those still prefilling included, which are about to decode (speculation.py).
        share = batch_share(len(self.active))
        for group in range(self.micro_batches):
            members = [s for s in self.active.values()
                       if self.groups.get(s.session_id) == group and not replaying(s.session_id)]
            ready = [s for s in members if s.next_token is not None]
            if not ready:
                continue
            # Wait for the stragglers of this step, but not for long: a lost reply must not hold
            # every other session until its deadline.
            in_flight = self.pending.decode_in_flight({s.session_id for s in members})
            if in_flight and now - min(s.ready_at for s in ready) < patience:
                continue
            if now < self._group_sent_at + spacing:
                self.group_due_at = min(self.group_due_at, self._group_sent_at + spacing)
                continue
            offers = [draft_offer(s, share) for s in ready]
            drafts = allocate(offers, self.pass_cost.fit()) if share else [0] * len(ready)
            for session, count in zip(ready, drafts, strict=True):
                session.pass_rows = len(ready) + sum(drafts)
                actions.append(self.send(session, session.next_decode(count)))
            self._group_sent_at = now
        return actions

    def prefill_chunks(self, now: float, step_s: float) -> list[Action]:
        """The next prompt chunk of every session still prefilling. While other sessions
        decode, one chunk per session per decode step (`step_s`), so a long prompt's prefill
        shares the stages with the running streams instead of freezing them; otherwise every
        chunk at once (docs/PROTOCOL.md §6)."""
        decoding = any(s.running and s.result.tokens for s in self.active.values())  # past their prefill
        actions: list[Action] = []
        for session in self.active.values():
            while session.has_chunks and (not decoding or session.next_chunk_at <= now):
                actions.append(self.send(session, session.next_chunk()))
                session.next_chunk_at = now + step_s
                if decoding:
                    break
        return actions

    def owed_stops_again(self, now: float, give_up_after_s: float) -> list[Action]:
        """Owed Stops go out again (best effort); after `give_up_after_s` the stages' own TTL is
        left to free the session (stage 0 may be gone for good)."""
        actions: list[Action] = []
        for session_id, (session, since) in list(self.owed_stops.items()):
            if now - since > give_up_after_s:
                del self.owed_stops[session_id]
            elif session_id not in self.active:  # a live session sends its own Stop
                actions.append(self.send(session, session.stop(), block=False))
        return actions
