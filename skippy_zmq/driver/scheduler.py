"""Socket-free scheduling of many sessions over one pipeline: admission, decode alignment,
pending requests and their deadlines, reply routing and liveness.

The scheduler owns no socket and reads no clock: every call takes the current time and returns
actions for a transport (`transport.py`, driven by `generate` or the serving engine) to carry
out, and the transport reports back what happened to each send. The session table and what is
due to send live in `lanes.py`, the replays after a stage failure in `recovery.py`. Requests
may be submitted, cancelled and finished at any time (docs/PROTOCOL.md §6).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import attrs

from skippy_zmq import defaults
from skippy_zmq.config import TopologyConfig
from skippy_zmq.driver.generation import Generation, GenerationRequest, GenerationState, take_run
from skippy_zmq.driver.lanes import Action, Lanes, Liveness, Pending, Send, Text, chunk_progress, progress_report
from skippy_zmq.driver.prefixes import PromptCache
from skippy_zmq.driver.recovery import Recovery, Replayer
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.driver.speculation import PassCost
from skippy_zmq.driver.stage_figures import FigureBook
from skippy_zmq.driver.watch import StagePlace, StageWatch
from skippy_zmq.errors import (
    RequestError,
    SkippyError,
    StageRefused,
    StageTimeout,
    TokenizerError,
    WireError,
)
from skippy_zmq.telemetry import HopTiming, hop_timings
from skippy_zmq.tokens.tokenizer import Tokenizer
from skippy_zmq.wire.messages import MAX_DRIVER_INCARNATION, MessageKind, driver_id_for, driver_word
from skippy_zmq.wire.replies import Reply, ReplyKind

MIN_PATIENCE_S = 0.05
"""The shortest wait for the stragglers of a decode step before the ready sessions go on."""
IDLE_POLL_S = 0.05
MAX_POLL_S = 0.25
GATHER_FRACTION = 0.25
"""An idle pipeline holds a new request this fraction of a decode step (at most `gather_max_s`)
for the requests that arrive with it, so their prompts prefill as one pass."""
GATHER_QUIET_S = 0.01
"""...but only while they keep arriving: the hold ends once no request has joined for this long (the
requests of a burst reach the scheduler a few ms apart; a lone client's first token would otherwise
come a quarter of a step late, 45 ms on an 8B model)."""


@attrs.frozen
class PipelineShape:
    """What scheduling needs of a topology: stage names, lanes and context."""

    labels: tuple[str, ...]
    stage_ids: tuple[str, ...]
    max_sessions: int
    ctx_size: int
    driver_id: int = 0  # 0: messages carry no driver word
    session_ttl_s: float = 600.0  # the shortest idle time after which a stage frees a session that decoded
    places: tuple[StagePlace, ...] = attrs.field()  # where each stage is, for the operator

    @places.default
    def _places(self) -> tuple[StagePlace, ...]:
        return tuple(StagePlace(index, stage_id) for index, stage_id in enumerate(self.stage_ids))

    @classmethod
    def from_topology(cls, topology: TopologyConfig) -> PipelineShape:
        """Sessions at once: the smallest lane count; positions: the smallest context."""
        stages = topology.stages
        return cls(
            labels=tuple(stage.label for stage in stages),
            stage_ids=tuple(stage.stage_id for stage in stages),
            max_sessions=min(stage.lane_count for stage in stages),
            ctx_size=min(stage.ctx_size for stage in stages),
            driver_id=driver_id_for(topology.driver.return_connect),
            session_ttl_s=min(stage.session_ttl_s for stage in stages),
            places=StagePlace.of_topology(topology),
        )

    def driver_word(self, incarnation: int) -> int:
        """The `driver_incarnation` word of a scheduler on this pipeline (0 without a driver id).
        New for every scheduler: a stage that sees it change for this driver id frees the sessions
        of the scheduler before it, a driver process that is gone (docs/PROTOCOL.md §6)."""
        return driver_word(self.driver_id, incarnation) if self.driver_id else 0


def _random_session_id() -> int:
    return secrets.randbits(63) + 1


def _random_incarnation() -> int:
    return secrets.randbelow(MAX_DRIVER_INCARNATION) + 1


class BurstGate:
    """Holds an idle pipeline's first waiting requests a moment for the ones that arrive with
    them, so that they start in the same prefill pass: started one by one, the first prompt runs
    alone and the others, arriving a moment later, wait behind it on every stage
    (docs/PROTOCOL.md §6). Socket-free; `max_s` 0 never holds."""

    def __init__(self, max_s: float) -> None:
        self.max_s = max_s
        self.since: float | None = None  # when the idle pipeline first saw a request waiting
        self.latest = 0.0  # when the hold last saw another request join
        self.seen = 0  # the waiting requests it saw then

    def window(self, step_s: float) -> float:
        """How long to hold: a fraction of a decode step's round trip, at most `max_s`."""
        return min(self.max_s, GATHER_FRACTION * step_s)

    def until(self, step_s: float) -> float:
        """When the open window closes (infinity when none is open): a quiet gap after the latest arrival,
        at most the window after the first."""
        if self.since is None:
            return float("inf")
        return min(self.since + self.window(step_s), self.latest + GATHER_QUIET_S)

    def holds(self, now: float, lanes: Lanes, max_sessions: int, step_s: float) -> bool:
        """True while the waiting requests are to be held (none runs, lanes are left, the window is open and
        requests joined within the quiet gap)."""
        waiting = lanes.waiting
        if not waiting or lanes.active or sum(1 + len(s.forks) for s in waiting) >= max_sessions:
            self.since = None
            return False
        if self.since is None or len(waiting) != self.seen:  # the hold opens, or another request joined
            self.since = now if self.since is None else self.since
            self.latest, self.seen = now, len(waiting)
        if now < self.until(step_s):
            return True
        self.since = None
        return False


def _take_tokens(session: Generation, asked: MessageKind, reply: Reply, now: float, hops: list[HopTiming]) -> str:
    """Give `session` the token (a verification's tokens) a reply to its `asked` message predicts; the text they
    release. WireError when the reply kind does not answer that message kind."""
    if (reply.kind is ReplyKind.PREDICTED_TOKENS) != (asked is MessageKind.VERIFY_EMBD):
        raise WireError(f"session {session.session_id}: the final stage answered {asked.name} with "
                        f"{reply.kind.name}; a verification is answered with PREDICTED_TOKENS, other kinds with "
                        "PREDICTED_TOKEN")
    if reply.kind is ReplyKind.PREDICTED_TOKENS:
        return take_run(session, reply.tokens.tolist(), now, hops, reply.token_logprobs)
    return session.accept(int(reply.predicted_token), now, hops, reply.logprobs)


def pipeline_drafts(settings: SchedulerSettings, figures: FigureBook) -> int:
    """The drafts a request that names none may carry: the settings', else `defaults.DRAFT_MAX` while every
    stage's latest heartbeat says it computes batch-invariantly (drafts then cannot change a text), else 0."""
    if settings.draft_max is not None:
        return settings.draft_max
    return defaults.DRAFT_MAX if figures.invariant else 0


def _timed_pass(step_s: float, cost: PassCost, rows: int, seconds: float) -> float:
    """The running mean of a decode step's round trip after one of `rows` rows took `seconds`, which the drafts'
    cost model learns too."""
    cost.observe(rows, seconds)
    return 0.8 * step_s + 0.2 * seconds


def group_spacing(step_s: float, micro_batches: int) -> float:
    """How far apart micro-batch groups step: a fraction of a round trip, so that the first stage
    starts one group's pass before the next group's step reaches it (none with one group)."""
    return step_s / (2 * micro_batches) if micro_batches > 1 else 0.0


class Scheduler:
    """Admits sessions up to the pipeline's lanes, aligns their decode steps, routes replies
    and enforces deadlines; every call returns the actions a transport must carry out."""

    def __init__(
        self,
        shape: PipelineShape,
        tokenizer: Tokenizer,
        settings: SchedulerSettings | None = None,
        *,
        new_session_id: Callable[[], int] = _random_session_id,
        incarnation: Callable[[], int] = _random_incarnation,
    ) -> None:
        """`settings`: a batch run's (`SchedulerSettings()`) when not given."""
        settings = settings or SchedulerSettings()
        self.shape = shape
        self.settings = settings
        # A full stage-0 queue is back-pressure: it drains as stage 0 finishes a message. A send
        # that waits longer than a stage may stay silent means stage 0 is gone.
        self.send_timeout_s = min(settings.reply_timeout_s, settings.silence_s)
        self.liveness = Liveness(shape.labels, settings.silence_s)
        self.step_s = 0.1  # running mean of a decode step's round trip
        self._tokenizer = tokenizer
        self._new_session_id = new_session_id
        self._recovery = Recovery(settings.recovery_timeout_s)
        self._lanes = Lanes(settings.micro_batches, on_retire=self._recovery.forget,
                            driver_incarnation=shape.driver_word(incarnation()))
        self.watch = StageWatch(shape.places, self.liveness, recovery_timeout_s=settings.recovery_timeout_s,
                                recovery_silence_s=settings.silence_s, send_timeout_s=self.send_timeout_s)
        self.figures = FigureBook(len(shape.labels))  # each stage's load and token split, for GET /stages
        self._replayer = Replayer(self._recovery, self._lanes, self.liveness, settings.prefill_chunk,
                                  settings.reply_timeout_s, new_word=lambda: shape.driver_word(incarnation()),
                                  watch=self.watch)
        self._submitted = 0
        self._burst = BurstGate(settings.gather_max_s)
        # Finished sessions kept on the stages, each for half the stages' TTL (stopped before a stage would free it).
        self.prompts = PromptCache(self._lanes, shape.session_ttl_s / 2, enabled=settings.cache_prompts)

    @property
    def waiting(self) -> int:
        """Sessions queued for a lane."""
        return len(self._lanes.waiting)

    @property
    def active(self) -> int:
        """Sessions holding a lane."""
        return len(self._lanes.active)

    @property
    def down(self) -> list[str]:
        """Labels of the stages that failed and are waited for (sessions replay once they are back)."""
        return [self.shape.labels[i] for i in self._recovery.down()]

    def starved(self, now: float) -> list[str]:
        """Labels of the stages that lately refused a session for lack of a free lane."""
        return [self.shape.labels[i] for i in self._recovery.starved(now) if 0 <= i < len(self.shape.labels)]

    # --- requests in and out ----------------------------------------------------------------

    def submit(self, request: GenerationRequest, *, index: int | None = None) -> Generation:
        """Queue a request (it starts on a later `tick`, once a lane is free); one that cannot run
        comes back already final. `index` (default: a count) labels its text and errors."""
        index = self._submitted if index is None else index
        self._submitted += 1
        if request.draft_max is None:  # the pipeline's own: `serve --draft-max`, else as its stages' numerics allow
            request = attrs.evolve(request, draft_max=pipeline_drafts(self.settings, self.figures))
        session = Generation.create(index, self._new_session_id(), request, self._tokenizer, self.shape.ctx_size)
        if request.n > self.shape.max_sessions and not session.done:
            session.fail(RequestError(f"request {index} asks for {request.n} choices; the pipeline runs at most "
                                      f"{self.shape.max_sessions} sessions at once (its lanes)"), 0.0)
        if not session.done:
            session.add_choices(self._new_session_id)
            self._lanes.waiting.append(session)
        return session

    def cancel(self, session: Generation, now: float) -> list[Action]:
        """Give up on a session: leave the queue, or free its lanes on every stage (best effort)."""
        actions = [a for fork in session.forks if fork.running for a in self.cancel(fork, now)]
        if session.done:
            return actions
        if session.running and session.session_id not in self._lanes.unopened:
            actions.append(self._lanes.send(session, session.stop(), block=False))
        session.cancel(now)
        return actions + self._lanes.retire(session)

    def tick(self, now: float) -> list[Action]:
        """Expire deadlines, send the decode steps that are due, admit waiting sessions."""
        actions = self._expire(now)
        actions += self._replayer.tick(now, self.step_s)  # give-ups, and the watch's look at the stages
        # Before sending (a send is awaited once sent): a session that awaits nothing and has
        # nothing to send got there by an answer out of protocol, and would wait forever.
        actions += self._lanes.fail_stuck(now, busy=self._lanes.pending.sessions() | self._recovery.waiting())
        actions += self._replayer.due(now, self.step_s)  # held errors fail, lane-refused sessions start over
        actions += self._lanes.owed_stops_again(now, self.settings.reply_timeout_s) + self.prompts.expire(now)
        if not self._recovery.holding:  # while a stage is down nothing leaves
            patience = max(MIN_PATIENCE_S, 3 * self.step_s)
            actions += self._lanes.decode_steps(now, patience, replaying=self._recovery.replaying,
                                                spacing=group_spacing(self.step_s, self.settings.micro_batches))
            if not self._burst.holds(now, self._lanes, self.shape.max_sessions, self.step_s):
                actions += self.prompts.admit(self.shape.max_sessions, self.settings.prefill_chunk, now, self.step_s)
            actions += self._lanes.prefill_chunks(now, self.step_s)
        return actions

    def poll_timeout(self, now: float) -> float:
        """How long the transport may wait for a reply before the next `tick`."""
        # While a stage is down no chunk leaves, and a session waiting to replay sends nothing.
        waiting = self._recovery.waiting()  # a set union: made once, not per session
        due = [] if self._recovery.holding else [
            s.next_chunk_at for s in self._lanes.active.values() if s.has_chunks and s.session_id not in waiting
        ]
        held_group = float("inf") if self._recovery.holding else self._lanes.group_due_at
        soonest = min([*due, self._burst.until(self.step_s), held_group,
                       self._lanes.pending.soonest_deadline() or float("inf")])
        if soonest == float("inf"):
            return IDLE_POLL_S
        return min(max(soonest - now, 0.0), MAX_POLL_S)

    # --- what the transport reports ---------------------------------------------------------

    def wants(self, send: Send) -> bool:
        """False for a send made pointless (its session ended, or a stage is down); a Stop always goes."""
        if send.message.kind is MessageKind.STOP:
            return True
        return not send.session.done and not self._recovery.holding

    def sent(self, send: Send, now: float) -> None:
        """Stage 0 took `send` at `now`: its reply deadline starts."""
        session, message = send.session, send.message
        self._lanes.unopened.discard(session.session_id)
        if message.kind is MessageKind.STOP:
            self._lanes.owed_stops.pop(session.session_id, None)
        if message.kind.expects_reply and not session.done:
            deadline = now + self.settings.reply_timeout_s
            self._lanes.pending.add(Pending(session, message.kind, message.request_id, now, deadline))

    def refused(self, send: Send, now: float) -> list[Action]:
        """Stage 0 did not take `send` in time. A refused Stop only ends a finished session. With
        recovery on, stage 0 is down (sessions replay once it is heard); otherwise the send fails its
        session, and, when a session was starting, every one that has sent nothing yet (§6)."""
        session, message = send.session, send.message
        if message.kind is MessageKind.STOP:
            # Owed: sent again on later ticks, its lane counted as held until it leaves, so a
            # full stage-0 queue never leaves a lane taken on the stages until their TTL.
            self._lanes.owed_stops.setdefault(session.session_id, (session, now))
            if session.state is GenerationState.STOPPING:
                session.stopped(now)  # the text is complete
                return self._lanes.retire(session)
            return []
        if self._recovery.enabled:
            return self._disrupted([0], now, back=False)
        self.watch.found_down([0], now)  # the operator hears of it with recovery off too
        error = StageRefused(
            f"session {session.session_id}: {self.shape.labels[0]} did not accept request "
            f"{message.request_id} ({message.kind.name}) within {self.send_timeout_s:g} s"
        )
        actions = self._lanes.fail(session, error, now)
        if not message.kind.decodes:
            unopened = [self._lanes.active[i] for i in self._lanes.unopened]
            for other in [*self._lanes.waiting, *unopened]:
                actions += self._lanes.fail(other, error, now)
        return actions

    def unsendable(self, send: Send, error: SkippyError, now: float) -> list[Action]:
        """`send` could not be encoded (a value the wire cannot carry): its session fails with `error`."""
        return self._lanes.fail(send.session, error, now)

    def on_reply(self, reply: Reply, now: float, received_us: int = 0) -> list[Action]:
        """Route a reply by (request_id, session_id); stale replies are ignored."""
        actions: list[Action] = []
        if self.liveness.heard(reply.stage_index, now, reply.incarnation):
            actions += self._disrupted([reply.stage_index], now, back=True)
        if self._recovery.holding:
            actions += self._replayer.recovered(now, self.step_s)
        if reply.is_heartbeat:
            self.figures.beat(reply.stage_index, reply.load, now)
            return actions
        pending = self._lanes.pending.pop(reply.request_id, reply.session_id)
        if pending is not None:
            return actions + self._answered(pending, reply, now, received_us)
        session = self._lanes.active.get(reply.session_id)
        current = session is not None and self._recovery.is_current(session.session_id, reply.request_id)
        if reply.kind is ReplyKind.ACK and session is not None and current:  # a prompt chunk's (§6, Prompt progress)
            return actions + chunk_progress(session, reply, now)
        if reply.kind is ReplyKind.ERROR and session is not None and current:
            # An error for a message nobody waits on (a non-final prefill chunk): it fails the
            # session now, with the real cause, instead of a later symptom.
            return actions + self._replayer.remote_error(session, reply, now)
        return actions  # stale: a reply to an earlier run, or for a session already ended

    def _answered(self, pending: Pending, reply: Reply, now: float, received_us: int) -> list[Action]:
        session = pending.session
        if reply.kind is ReplyKind.ERROR:
            return self._replayer.remote_error(session, reply, now)
        if reply.kind is ReplyKind.ACK and pending.kind is MessageKind.STOP and not session.running:
            session.stopped(now)  # the Stop of a finished session (a replay's Stop goes on)
            return self._lanes.retire(session)
        if reply.kind is ReplyKind.ACK or not session.running:
            return []
        hops = hop_timings(reply.trace, received_us)
        if pending.kind.decodes:  # a token's time: the prompt's passes would swamp it
            self.figures.token(hops, now)
        progress = (progress_report(session, len(session.result.prompt_ids), now)  # before the first token's text
                    if pending.kind is MessageKind.PREFILL_FINAL_EMBD else [])
        try:
            if reply.kind is ReplyKind.EMBEDDING and reply.embedding is not None:
                session.accept_embedding(reply.embedding, now, hops)
                return [self._lanes.send(session, session.stop(), block=False)]
            text = _take_tokens(session, pending.kind, reply, now, hops)
        except (TokenizerError, WireError) as exc:  # the pipeline's fault: a token outside the vocab or
            # without the logprobs asked for
            return self._lanes.fail(session, exc, now)
        actions: list[Action] = [*progress, Text(session, text)] if text else [*progress]
        if pending.kind is MessageKind.PREFILL_FINAL_EMBD:
            actions += self._lanes.fork_choices(session, now)
        if session.state is GenerationState.STOPPING:
            kept = self.prompts.keep(session, now)  # retained: no Stop, the lane and KV stay
            actions += [self._lanes.send(session, session.stop(), block=False)] if kept is None else kept
        elif pending.kind.decodes:
            self.step_s = _timed_pass(self.step_s, self._lanes.pass_cost, session.pass_rows, now - pending.sent_at)
        return actions

    def _disrupted(self, stages: list[int], now: float, *, back: bool) -> list[Action]:
        """Stages lost sessions: the running ones replay (`Replayer.disrupted`), the retained ones go."""
        return self.prompts.drop() + self._replayer.disrupted(stages, now, back=back, step_s=self.step_s)

    def _expire(self, now: float) -> list[Action]:
        actions: list[Action] = []
        silent_stages = self.liveness.silent_indexes(now)
        if silent_stages and self._recovery.enabled and self._lanes.pending.waited_longer(now, self.settings.silence_s):
            # A stage went quiet while requests wait on it: it is down. Its sessions start over
            # once it is back (a supervisor restarts it), or fail after the recovery timeout.
            actions += self._disrupted(silent_stages, now, back=False)
        silent = self.liveness.silent(now)
        for pending in self._lanes.pending.take_overdue(now, self.settings.silence_s if silent else None):
            session = pending.session
            if session.done:
                continue
            if pending.kind is MessageKind.STOP and session.state is GenerationState.STOPPING:
                session.stopped(now)  # the text is complete; a lost Stop Ack is not the user's loss
                actions += self._lanes.retire(session)
                continue
            if pending.kind is MessageKind.STOP and session.running:
                continue  # a replay's Stop: what it frees, the stages' TTL frees as well
            detail = "; ".join(silent) if silent else "every stage is sending heartbeats"
            error = StageTimeout(
                f"session {session.session_id}: no reply to request {pending.request_id} ({pending.kind.name}) "
                f"after {now - pending.sent_at:.1f} s; {detail} (pipeline stages: {', '.join(self.shape.stage_ids)})"
            )
            actions += self._lanes.fail(session, error, now)
        return actions

