"""Tests of skippy_zmq.scheduler: admission, decode alignment, deadlines and reply routing,
driven in-process with a scripted clock and a fake transport (no sockets, no sleeping)."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest

from skippy_zmq.config import TopologyConfig
from skippy_zmq.driver.generation import Generation, GenerationRequest, GenerationState
from skippy_zmq.driver.lanes import Action, Finished, Progress, Send, Text
from skippy_zmq.driver.recovery import LANE_RETRY_S, STARVED_S, SUSPECT_GRACE_S
from skippy_zmq.driver.scheduler import GATHER_FRACTION, GATHER_QUIET_S, PipelineShape, Scheduler
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.errors import RemoteStageError, StageRefused, StageTimeout, WireError
from skippy_zmq.launch.topology import topology_toml
from skippy_zmq.wire.messages import MessageKind, StageMessage, driver_id_for, driver_word
from skippy_zmq.wire.options import GenerationOptions
from skippy_zmq.wire.replies import ErrorCause, Reply, ReplyKind
from tests.driver.test_generation import EOS, TOKENIZER, ids

LABELS = ('stage 0 "s0" (layers 0..2)', 'stage 1 "s1" (layers 2..4)')
SHAPE = PipelineShape(labels=LABELS, stage_ids=("s0", "s1"), max_sessions=2, ctx_size=64)
PROMPT = (2, *ids("he", "llo"))


class FakeTransport:
    """Carries out a scheduler's actions like driver.py does, recording instead of sending."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.sent: list[StageMessage] = []
        self.attempts: list[StageMessage] = []
        self.text: dict[int, str] = {}
        self.finished: list[Generation] = []
        self.progress: list[tuple[int, int, float]] = []  # (session index, processed, time_ms)
        self.full = False  # stage 0 takes nothing: blocking sends time out
        self.drops_best_effort = False  # stage 0's queue is full: non-blocking sends fail

    def perform(self, actions: Sequence[Action], now: float) -> None:
        """Every action in order; refused sends report back, as zmq.Again does."""
        queue = deque(actions)
        while queue:
            action = queue.popleft()
            if isinstance(action, Text):
                self.text[action.session.index] = self.text.get(action.session.index, "") + action.text
            elif isinstance(action, Finished):
                self.finished.append(action.session)
            elif isinstance(action, Progress):
                self.progress.append((action.session.index, action.processed, action.time_ms))
            elif self.scheduler.wants(action):
                self.attempts.append(action.message)
                if self.full or (self.drops_best_effort and not action.block):
                    queue.extend(self.scheduler.refused(action, now))
                else:
                    self.sent.append(action.message)
                    self.scheduler.sent(action, now)

    def tick(self, now: float) -> None:
        """One pass of the driver loop after its poll."""
        self.perform(self.scheduler.tick(now), now)

    def reply(self, reply: Reply, now: float) -> None:
        """A reply arrived at `now`."""
        self.perform(self.scheduler.on_reply(reply, now), now)

    def last(self, session: Generation, kind: MessageKind | None = None) -> StageMessage:
        """The last message sent for `session` (of `kind`)."""
        return [m for m in self.sent if m.session_id == session.session_id and kind in (None, m.kind)][-1]

    def kinds(self, session: Generation) -> list[MessageKind]:
        """Kinds of the messages sent for `session`, in order."""
        return [m.kind for m in self.sent if m.session_id == session.session_id]


def scheduler(shape: PipelineShape = SHAPE, prefill_chunk: int = 4, micro_batches: int = 1,
              recovery_timeout_s: float = 0.0, gather_max_s: float = 0.0,
              cache_prompts: bool = False) -> tuple[Scheduler, FakeTransport]:
    """Replies due in 10 s, stages silent after 3 s, session ids 101, 102, ...; no recovery
    unless `recovery_timeout_s` is given, no prompt cache unless `cache_prompts`."""
    settings = SchedulerSettings(reply_timeout_s=10.0, silence_s=3.0, prefill_chunk=prefill_chunk,
                                 micro_batches=micro_batches, recovery_timeout_s=recovery_timeout_s,
                                 gather_max_s=gather_max_s, cache_prompts=cache_prompts)
    sched = Scheduler(shape, TOKENIZER, settings, new_session_id=itertools.count(101).__next__)
    return sched, FakeTransport(sched)


def request(max_tokens: int = 8, prompt_ids: Sequence[int] = PROMPT) -> GenerationRequest:
    return GenerationRequest(prompt="p", max_tokens=max_tokens, prompt_ids=tuple(prompt_ids))


def token(message: StageMessage, value: int, stage: int = 1) -> Reply:
    return Reply(kind=ReplyKind.PREDICTED_TOKEN, request_id=message.request_id, session_id=message.session_id,
                 stage_index=stage, predicted_token=value)


def ack(message: StageMessage, stage: int = 1) -> Reply:
    return Reply(kind=ReplyKind.ACK, request_id=message.request_id, session_id=message.session_id,
                 stage_index=stage, answered=message.kind)


def error(message: StageMessage, text: str, stage: int = 0) -> Reply:
    return Reply(kind=ReplyKind.ERROR, request_id=message.request_id, session_id=message.session_id,
                 stage_index=stage, error=text)


def first_token(wire: FakeTransport, session: Generation, value: int, now: float) -> None:
    """Answer the session's configure and final prefill chunk."""
    wire.reply(ack(wire.last(session, MessageKind.CONFIGURE_GENERATION)), now)
    wire.reply(token(wire.last(session, MessageKind.PREFILL_FINAL_EMBD), value), now)


def test_admission_queues_beyond_the_lane_count_and_fills_freed_lanes() -> None:
    sched, wire = scheduler()
    a, b, c = (sched.submit(request(max_tokens=1)) for _ in range(3))
    assert [s.index for s in (a, b, c)] == [0, 1, 2]
    wire.tick(0.0)
    assert (sched.active, sched.waiting) == (2, 1)
    assert wire.kinds(a) == [MessageKind.CONFIGURE_GENERATION, MessageKind.PREFILL_FINAL_EMBD]
    assert wire.kinds(c) == [] and c.state is GenerationState.WAITING
    first_token(wire, a, ids("he")[0], now=0.5)  # max_tokens 1: finished, Stop sent
    assert wire.kinds(a)[-1] is MessageKind.STOP and a.state is GenerationState.STOPPING
    wire.tick(0.6)
    assert wire.kinds(c) == []  # a still holds its lane until the Stop is answered
    wire.reply(ack(wire.last(a, MessageKind.STOP)), now=0.7)
    assert a.state is GenerationState.FINISHED and wire.finished == [a]
    wire.tick(0.8)
    assert wire.kinds(c) == [MessageKind.CONFIGURE_GENERATION, MessageKind.PREFILL_FINAL_EMBD]
    assert c.result.started_s == 0.8 and (sched.active, sched.waiting) == (2, 0)


SHAPE4 = PipelineShape(labels=LABELS, stage_ids=("s0", "s1"), max_sessions=4, ctx_size=64)


def test_an_idle_pipeline_holds_a_new_request_for_those_arriving_with_it() -> None:
    sched, wire = scheduler(SHAPE4, gather_max_s=0.05)
    window = GATHER_FRACTION * sched.step_s  # 0.025 s with the first step estimate (0.1 s)
    assert window / 2 > GATHER_QUIET_S
    a = sched.submit(request())
    wire.tick(0.0)
    assert wire.sent == [] and sched.waiting == 1
    assert sched.poll_timeout(0.0) == pytest.approx(GATHER_QUIET_S)  # the engine wakes when the gap ends
    b = sched.submit(request())
    wire.tick(GATHER_QUIET_S * 0.9)  # b joined: the hold goes on for another gap
    c = sched.submit(request())
    wire.tick(GATHER_QUIET_S * 1.8)  # c joined too
    assert wire.sent == []
    wire.tick(window)  # arrivals go on, but the window is over
    prefills = [m.session_id for m in wire.sent if m.kind is MessageKind.PREFILL_FINAL_EMBD]
    assert prefills == [a.session_id, b.session_id, c.session_id] and sched.active == 3  # one wave


def test_a_lone_request_waits_only_the_quiet_gap_not_the_whole_window() -> None:
    sched, wire = scheduler(SHAPE4, gather_max_s=0.05)
    a = sched.submit(request())
    wire.tick(0.0)
    wire.tick(GATHER_QUIET_S * 0.99)
    assert wire.sent == []
    wire.tick(GATHER_QUIET_S)  # nobody joined: it starts long before the window (a quarter of a step) ends
    assert wire.kinds(a) == [MessageKind.CONFIGURE_GENERATION, MessageKind.PREFILL_FINAL_EMBD]


def test_a_burst_that_fills_the_lanes_starts_at_once_and_a_busy_pipeline_never_holds() -> None:
    sched, wire = scheduler(SHAPE4, gather_max_s=0.05)
    _a, b, _c, _d = (sched.submit(request()) for _ in range(4))
    wire.tick(0.0)  # every lane asked for: nothing more can join
    assert sched.active == 4
    wire.perform(sched.cancel(b, 0.2), 0.2)
    wire.reply(ack(wire.last(b, MessageKind.STOP)), now=0.2)
    e = sched.submit(request())
    wire.tick(0.2)  # sessions still run: a new one joins them at once, as before
    assert wire.kinds(e)[:1] == [MessageKind.CONFIGURE_GENERATION]


def test_without_a_gather_window_a_request_starts_on_the_first_tick() -> None:
    sched, wire = scheduler(SHAPE4)
    a = sched.submit(request())
    wire.tick(0.0)
    assert wire.kinds(a) == [MessageKind.CONFIGURE_GENERATION, MessageKind.PREFILL_FINAL_EMBD]


def test_decode_steps_of_ready_sessions_travel_together() -> None:
    sched, wire = scheduler()
    a, b = sched.submit(request()), sched.submit(request())
    wire.tick(0.0)
    first_token(wire, a, ids("he")[0], now=1.0)
    first_token(wire, b, ids("llo")[0], now=1.0)
    wire.tick(1.0)
    decodes = [m for m in wire.sent if m.kind is MessageKind.DECODE_EMBD]
    assert [(m.session_id, m.pos_start, int(m.tokens[0])) for m in decodes] == [
        (a.session_id, 3, ids("he")[0]), (b.session_id, 3, ids("llo")[0])]


def test_a_ready_session_waits_for_stragglers_only_as_long_as_the_patience() -> None:
    sched, wire = scheduler()
    a, b = sched.submit(request()), sched.submit(request())
    wire.tick(0.0)
    first_token(wire, a, ids("he")[0], now=1.0)
    first_token(wire, b, ids("he")[0], now=1.0)
    wire.tick(1.0)
    wire.reply(token(wire.last(a, MessageKind.DECODE_EMBD), ids("llo")[0]), now=1.2)
    patience = max(0.05, 3 * sched.step_s)
    assert sched.step_s == pytest.approx(0.8 * 0.1 + 0.2 * 0.2)
    wire.tick(1.2 + patience - 0.01)  # b's step is still in flight: a waits for it
    assert len(wire.kinds(a)) == 3
    wire.tick(1.2 + patience)  # b's reply may be lost: a goes on alone
    assert wire.kinds(a)[-1] is MessageKind.DECODE_EMBD and wire.last(a).pos_start == 4
    assert len(wire.kinds(b)) == 3


def test_micro_batch_groups_send_their_steps_independently() -> None:
    shape = PipelineShape(labels=LABELS, stage_ids=("s0", "s1"), max_sessions=4, ctx_size=64)
    sched, wire = scheduler(shape, micro_batches=2)
    a, b, c, d = (sched.submit(request()) for _ in range(4))
    wire.tick(0.0)
    for session in (a, b, c, d):
        first_token(wire, session, ids("he")[0], now=1.0)
    wire.tick(1.0)  # every group's token is in: group 0 steps, group 1 a fraction of a step later
    assert [len(wire.kinds(s)) for s in (a, b, c, d)] == [3, 2, 3, 2]
    spacing = sched.step_s / 4  # a quarter of a round trip with two groups
    assert sched.poll_timeout(1.0) == pytest.approx(spacing)  # the transport wakes for it
    wire.tick(1.0 + spacing * 0.9)
    assert [len(wire.kinds(s)) for s in (a, b, c, d)] == [3, 2, 3, 2]
    wire.tick(1.0 + spacing)  # so the first stage has started group 0's pass before group 1 comes
    assert [len(wire.kinds(s)) for s in (a, b, c, d)] == [3, 3, 3, 3]
    assert sched.poll_timeout(1.0 + spacing) > spacing  # nothing held back any more
    # Groups alternate at admission: a and c form group 0, b and d group 1. Group 0's tokens
    # come back while group 1 is still in flight: group 0 steps again without waiting for it.
    for session in (a, c):
        wire.reply(token(wire.last(session, MessageKind.DECODE_EMBD), ids("llo")[0]), now=1.1)
    wire.tick(1.1)
    assert [len(wire.kinds(s)) for s in (a, b, c, d)] == [4, 3, 4, 3]
    assert wire.last(a).pos_start == wire.last(c).pos_start == 4


def test_one_group_steps_at_once_and_steps_in_a_row_keep_their_pace() -> None:
    # With one group there is nothing to space; with two, a group whose token comes a round trip
    # after the other's last step is not held back.
    shape = PipelineShape(labels=LABELS, stage_ids=("s0", "s1"), max_sessions=4, ctx_size=64)
    sched, wire = scheduler(shape, micro_batches=1)
    a, b = sched.submit(request()), sched.submit(request())
    wire.tick(0.0)
    for session in (a, b):
        first_token(wire, session, ids("he")[0], now=1.0)
    wire.tick(1.0)
    assert [len(wire.kinds(s)) for s in (a, b)] == [3, 3]
    sched, wire = scheduler(shape, micro_batches=2)
    a, b = sched.submit(request()), sched.submit(request())  # groups 0 and 1
    wire.tick(0.0)
    first_token(wire, a, ids("he")[0], now=1.0)
    wire.tick(1.0)
    first_token(wire, b, ids("he")[0], now=1.2)
    wire.tick(1.2)  # 0.2 s after group 0 stepped: well past the spacing
    assert [len(wire.kinds(s)) for s in (a, b)] == [3, 3]


def test_a_straggler_that_arrives_within_the_patience_joins_the_step() -> None:
    sched, wire = scheduler()
    a, b = sched.submit(request()), sched.submit(request())
    wire.tick(0.0)
    first_token(wire, a, ids("he")[0], now=1.0)
    first_token(wire, b, ids("he")[0], now=1.0)
    wire.tick(1.0)
    wire.reply(token(wire.last(a, MessageKind.DECODE_EMBD), ids("llo")[0]), now=1.1)
    wire.tick(1.11)
    wire.reply(token(wire.last(b, MessageKind.DECODE_EMBD), ids("llo")[0]), now=1.12)
    wire.tick(1.12)
    last_two = wire.sent[-2:]
    assert [m.kind for m in last_two] == [MessageKind.DECODE_EMBD] * 2
    assert {m.session_id for m in last_two} == {a.session_id, b.session_id}


def test_a_session_runs_to_eos_and_streams_its_text() -> None:
    sched, wire = scheduler()
    session = sched.submit(request())
    wire.tick(0.0)
    first_token(wire, session, ids("he")[0], now=1.0)
    for now, value in ((1.1, ids("llo")[0]), (1.2, EOS)):
        wire.tick(now)
        wire.reply(token(wire.last(session, MessageKind.DECODE_EMBD), value), now)
    assert wire.text == {0: "hello"}
    wire.reply(ack(wire.last(session, MessageKind.STOP)), now=1.3)
    assert session.state is GenerationState.FINISHED and session.result.finish_reason == "eos"
    assert session.result.tokens == [*ids("he", "llo"), EOS]
    assert (session.result.first_token_s, session.result.finished_s) == (1.0, 1.2)


def test_a_missing_reply_expires_naming_the_silent_stage() -> None:
    sched, wire = scheduler()
    session = sched.submit(request())
    wire.reply(Reply.heartbeat(0, 0), now=0.0)
    wire.reply(Reply.heartbeat(1, 0), now=0.5)
    wire.tick(0.0)
    wire.reply(Reply.heartbeat(0, 0), now=3.4)
    wire.tick(3.4)
    assert session.running  # stage 1 was heard 2.9 s ago: not yet silent
    wire.tick(3.6)
    assert session.state is GenerationState.FAILED and isinstance(session.error, StageTimeout)
    message = str(session.error)
    assert message.startswith(f"session {session.session_id}: no reply to request 1 (CONFIGURE_GENERATION) after 3.6 s;")
    assert f"{LABELS[1]} is silent (last heartbeat 3.1 s ago)" in message and LABELS[0] not in message
    assert message.endswith("(pipeline stages: s0, s1)")
    assert wire.kinds(session)[-1] is MessageKind.STOP  # best effort: free what is still alive
    assert wire.finished == [session] and sched.active == 0


def test_a_missing_reply_with_every_stage_alive_expires_at_its_deadline() -> None:
    sched, wire = scheduler()
    session = sched.submit(request())
    wire.tick(0.0)
    for now in (0.0, 2.0, 4.0, 6.0, 8.0, 9.9):
        wire.reply(Reply.heartbeat(0, 0), now)
        wire.reply(Reply.heartbeat(1, 0), now)
        wire.tick(now)
    assert session.running
    wire.tick(10.0)
    assert "after 10.0 s; every stage is sending heartbeats" in str(session.error)
    assert sched.liveness.missing_since(9.0) == []
    assert sched.liveness.missing_since(9.95) == list(LABELS)


def test_stage_zero_refusing_a_send_fails_every_prompt_not_yet_sent_the_same_way() -> None:
    sched, wire = scheduler()
    sessions = [sched.submit(request()) for _ in range(4)]
    wire.full = True
    wire.tick(0.0)
    # One attempt only: the second admitted session and the queued ones are not tried.
    assert len(wire.attempts) == 1 and wire.sent == []
    assert all(s.state is GenerationState.FAILED for s in sessions)
    errors = {id(s.error) for s in sessions}
    assert len(errors) == 1 and isinstance(sessions[0].error, StageRefused)
    assert isinstance(sessions[0].error, StageTimeout)
    assert str(sessions[0].error) == (
        f"session {sessions[0].session_id}: {LABELS[0]} did not accept request 1 (CONFIGURE_GENERATION) within 3 s")
    assert all(s.result.error == str(sessions[0].error) for s in sessions)
    assert (sched.active, sched.waiting) == (0, 0)


def test_a_refused_decode_step_fails_its_session_and_the_queue_tries_for_itself() -> None:
    sched, wire = scheduler(shape=PipelineShape(LABELS, ("s0", "s1"), max_sessions=1, ctx_size=64))
    a, b = sched.submit(request()), sched.submit(request())
    wire.tick(0.0)
    first_token(wire, a, ids("he")[0], now=1.0)
    wire.full = True
    wire.tick(1.0)
    assert isinstance(a.error, StageRefused) and "(DECODE_EMBD)" in str(a.error)
    assert wire.text == {0: "he"}
    assert b.state is GenerationState.WAITING
    wire.tick(1.1)  # a's Stop was refused too: its lane stays held while the Stop is owed
    assert b.state is GenerationState.WAITING
    wire.tick(1.0 + 10.0 + 0.1)  # past reply_timeout_s the stages' TTL is left to free it
    assert isinstance(b.error, StageRefused) and "(CONFIGURE_GENERATION)" in str(b.error)


def test_a_refused_stop_is_sent_again_and_holds_its_lane_until_then() -> None:
    sched, wire = scheduler(shape=PipelineShape(LABELS, ("s0", "s1"), max_sessions=1, ctx_size=64))
    a, b = sched.submit(request()), sched.submit(request())
    wire.tick(0.0)
    first_token(wire, a, ids("he")[0], now=1.0)
    wire.drops_best_effort = True  # stage 0's queue is full: the Stop of the cancel is refused
    wire.perform(sched.cancel(a, 1.0), 1.0)
    assert wire.kinds(a).count(MessageKind.STOP) == 0 and a.done
    wire.tick(1.1)
    assert b.state is GenerationState.WAITING  # a's lane is still taken on the stages
    wire.drops_best_effort = False
    wire.tick(1.2)  # the owed Stop leaves, then b takes the lane
    assert wire.kinds(a)[-1] is MessageKind.STOP
    wire.tick(1.3)
    assert b.state is GenerationState.RUNNING


def test_an_error_for_a_non_final_prefill_chunk_fails_its_session_with_the_cause() -> None:
    sched, wire = scheduler()
    bad = sched.submit(request(prompt_ids=[2, *ids("he", "llo", "he", "llo", "!")]))
    good = sched.submit(request())
    wire.tick(0.0)
    chunk = wire.last(bad, MessageKind.PREFILL_EMBD)
    cause = 'stage 0 "s0": token id 9999 is outside the vocab'
    wire.reply(error(chunk, cause), now=0.1)
    assert bad.state is GenerationState.FAILED and isinstance(bad.error, RemoteStageError)
    assert bad.result.error == cause
    assert wire.kinds(bad)[-1] is MessageKind.STOP
    # Its later replies are stale; the other session goes on.
    wire.reply(token(wire.last(bad, MessageKind.PREFILL_FINAL_EMBD), ids("he")[0]), now=0.2)
    first_token(wire, good, ids("he")[0], now=0.2)
    assert bad.result.tokens == [] and good.result.tokens == ids("he")
    assert good.running


def chunk_ack(message: StageMessage) -> Reply:
    """The final stage's Ack of a prompt chunk for a session that asked for progress: the positions it holds."""
    return Reply(kind=ReplyKind.ACK, request_id=message.request_id, session_id=message.session_id, stage_index=1,
                 answered=MessageKind.PREFILL_EMBD, predicted_token=message.pos_start + message.token_count)


def test_a_session_that_asks_hears_its_prompts_progress_at_start_per_chunk_and_whole() -> None:
    sched, wire = scheduler(prefill_chunk=4)
    prompt = [2, *ids("he", "llo", "he", "llo", "he", "llo", "he", "llo")]
    quiet = sched.submit(request(prompt_ids=prompt))
    session = sched.submit(attrs.evolve(request(prompt_ids=prompt), progress=True))
    for step in range(6):  # the chunks leave one tick after another
        wire.tick(0.1 * step)
    assert wire.progress == [(1, 0, 0.0)]  # before any position runs: nothing cached, nothing processed
    configure = wire.last(session, MessageKind.CONFIGURE_GENERATION)
    assert configure.options is not None and configure.options.progress
    assert not wire.last(quiet, MessageKind.CONFIGURE_GENERATION).options.progress  # type: ignore[union-attr]
    chunks = [m for m in wire.sent if m.session_id == session.session_id and m.kind is MessageKind.PREFILL_EMBD]
    assert len(chunks) == (len(prompt) - 1) // 4
    wire.reply(chunk_ack(chunks[0]), now=0.6)
    wire.reply(chunk_ack(chunks[0]), now=0.61)  # a duplicate is no news
    wire.reply(chunk_ack(chunks[1]), now=0.7)
    for quiet_chunk in [m for m in wire.sent if m.session_id == quiet.session_id and m.kind is MessageKind.PREFILL_EMBD]:
        wire.reply(chunk_ack(quiet_chunk), now=0.71)  # a session that did not ask reports nothing
    first_token(wire, session, ids("he")[0], now=0.8)
    started = session.result.started_s
    assert wire.progress == [(1, 0, 0.0), (1, 4, round((0.6 - started) * 1000, 3)),
                             (1, 8, round((0.7 - started) * 1000, 3)), (1, len(prompt), round((0.8 - started) * 1000, 3))]
    assert session.result.tokens == ids("he")


def test_stale_and_duplicate_replies_are_ignored() -> None:
    sched, wire = scheduler()
    session = sched.submit(request())
    wire.tick(0.0)
    final = wire.last(session, MessageKind.PREFILL_FINAL_EMBD)
    stranger = Reply(kind=ReplyKind.PREDICTED_TOKEN, request_id=999, session_id=5, stage_index=1, predicted_token=3)
    assert sched.on_reply(stranger, 0.1) == []
    not_ours = Reply(kind=ReplyKind.ERROR, request_id=1, session_id=5, stage_index=1, error="not ours")
    assert sched.on_reply(not_ours, 0.1) == []
    wire.reply(token(final, ids("he")[0]), now=0.2)
    assert sched.on_reply(token(final, ids("llo")[0]), 0.3) == []  # the same request again
    assert session.result.tokens == ids("he")


def test_a_reply_of_an_unexpected_kind_fails_the_session_instead_of_hanging() -> None:
    sched, wire = scheduler()
    session = sched.submit(request())
    wire.tick(0.0)
    wire.reply(ack(wire.last(session, MessageKind.CONFIGURE_GENERATION)), now=0.1)
    wire.reply(ack(wire.last(session, MessageKind.PREFILL_FINAL_EMBD)), now=0.1)  # an Ack, not a token
    wire.tick(0.2)
    assert isinstance(session.error, WireError)
    assert "no request outstanding; the pipeline answered out of protocol" in str(session.error)


def test_cancel_leaves_the_queue_or_frees_the_lanes() -> None:
    sched, wire = scheduler(shape=PipelineShape(LABELS, ("s0", "s1"), max_sessions=1, ctx_size=64))
    running, queued, later = (sched.submit(request()) for _ in range(3))
    wire.tick(0.0)
    wire.perform(sched.cancel(queued, 0.5), 0.5)
    assert queued.state is GenerationState.CANCELLED and wire.kinds(queued) == []
    wire.perform(sched.cancel(running, 0.5), 0.5)
    assert running.state is GenerationState.CANCELLED and wire.kinds(running)[-1] is MessageKind.STOP
    assert sched.poll_timeout(0.5) == 0.05  # nothing awaited: the Stop's Ack is not
    assert sched.on_reply(token(wire.last(running, MessageKind.PREFILL_FINAL_EMBD), 5), 0.6) == []
    wire.tick(0.7)
    assert later.running and wire.kinds(later)[0] is MessageKind.CONFIGURE_GENERATION
    assert sched.cancel(running, 0.8) == []
    assert wire.finished == [queued, running]


def test_a_lost_or_refused_stop_still_finishes_the_text() -> None:
    sched, wire = scheduler()
    lost, refused = sched.submit(request(max_tokens=1)), sched.submit(request(max_tokens=1))
    wire.tick(0.0)
    wire.reply(Reply.heartbeat(0, 0), 0.0)
    wire.reply(Reply.heartbeat(1, 0), 0.0)
    first_token(wire, lost, ids("he")[0], now=0.1)
    wire.drops_best_effort = True
    first_token(wire, refused, ids("he")[0], now=0.1)
    assert refused.state is GenerationState.FINISHED and refused.error is None
    assert lost.state is GenerationState.STOPPING
    for now in (2.0, 4.0, 6.0, 8.0):
        wire.reply(Reply.heartbeat(0, 0), now)
        wire.reply(Reply.heartbeat(1, 0), now)
    wire.tick(10.2)
    assert lost.state is GenerationState.FINISHED and lost.error is None
    assert lost.result.finish_reason == refused.result.finish_reason == "length"


def test_poll_timeout_follows_the_soonest_deadline() -> None:
    sched, wire = scheduler()
    assert sched.poll_timeout(0.0) == 0.05
    sched.submit(request())
    wire.tick(0.0)
    assert sched.poll_timeout(1.0) == 0.25
    assert sched.poll_timeout(9.9) == pytest.approx(0.1)
    assert sched.poll_timeout(11.0) == 0.0


def test_requests_that_cannot_run_never_take_a_lane() -> None:
    sched, wire = scheduler()
    empty = sched.submit(GenerationRequest(prompt=""))
    assert empty.state is GenerationState.FAILED and sched.waiting == 0
    wire.tick(0.0)
    assert wire.sent == []


def test_sends_are_named_by_request_and_session() -> None:
    sched, wire = scheduler()
    session = sched.submit(request())
    wire.tick(0.0)
    assert [m.request_id for m in wire.sent] == [1, 2]
    assert all(isinstance(m, StageMessage) and m.session_id == session.session_id == 101 for m in wire.sent)
    assert not any(isinstance(a, Send) for a in sched.tick(0.1))


def test_a_long_prompt_is_fed_one_chunk_per_step_while_others_decode() -> None:
    sched, wire = scheduler(prefill_chunk=4)
    a = sched.submit(request())
    wire.tick(0.0)
    first_token(wire, a, ids("he")[0], now=1.0)  # a now decodes
    long_prompt = request(prompt_ids=PROMPT * 3)  # 9 tokens: chunks of 4, 4 and 1
    b = sched.submit(long_prompt)
    wire.tick(1.0)
    chunk = MessageKind.PREFILL_EMBD
    assert wire.kinds(b) == [MessageKind.CONFIGURE_GENERATION, chunk]
    assert wire.kinds(a)[-1] is MessageKind.DECODE_EMBD
    wire.tick(1.0 + sched.step_s / 2)  # not yet: one chunk per decode step
    assert wire.kinds(b) == [MessageKind.CONFIGURE_GENERATION, chunk]
    assert sched.poll_timeout(1.0 + sched.step_s / 2) == pytest.approx(sched.step_s / 2)
    wire.tick(1.0 + sched.step_s)
    wire.tick(1.0 + 2.5 * sched.step_s)
    assert wire.kinds(b) == [MessageKind.CONFIGURE_GENERATION, chunk, chunk, MessageKind.PREFILL_FINAL_EMBD]
    assert [m.pos_start for m in wire.sent if m.session_id == b.session_id][1:] == [0, 4, 8]


def test_with_nobody_decoding_a_prompt_goes_out_whole() -> None:
    sched, wire = scheduler(prefill_chunk=4)
    b = sched.submit(request(prompt_ids=PROMPT * 3))
    wire.tick(0.0)
    assert wire.kinds(b) == [MessageKind.CONFIGURE_GENERATION, MessageKind.PREFILL_EMBD, MessageKind.PREFILL_EMBD,
                             MessageKind.PREFILL_FINAL_EMBD]


# --- recovery: a stage restarted or silent, sessions replayed -------------------------------


def beat(wire: FakeTransport, now: float, incarnations: Sequence[int] = (11, 21)) -> None:
    """A heartbeat from every stage, each with its incarnation id."""
    for stage, incarnation in enumerate(incarnations):
        wire.reply(Reply.heartbeat(stage, 0, incarnation), now)


def decoding(sched: Scheduler, wire: FakeTransport) -> tuple[Generation, Generation]:
    """Two sessions past their first token, one decode step each in flight (at t = 1)."""
    beat(wire, 0.0)
    a, b = sched.submit(request()), sched.submit(request())
    wire.tick(0.0)
    first_token(wire, a, ids("he")[0], now=0.5)
    first_token(wire, b, ids("llo")[0], now=0.5)
    wire.tick(1.0)
    return a, b


def test_a_restarted_stage_makes_every_running_session_start_over_from_prompt_and_tokens() -> None:
    sched, wire = scheduler(recovery_timeout_s=30.0)
    a, b = decoding(sched, wire)
    lost = wire.last(a, MessageKind.DECODE_EMBD)
    before = len(wire.sent)
    beat(wire, 1.5, incarnations=(11, 22))  # stage 1 is a new process: its sessions are gone
    replayed = wire.sent[before:]
    for session in (a, b):
        mine = [m for m in replayed if m.session_id == session.session_id]
        assert [m.kind for m in mine] == [MessageKind.STOP, MessageKind.CONFIGURE_GENERATION,
                                         MessageKind.PREFILL_FINAL_EMBD]
        assert [int(t) for t in mine[-1].tokens] == [*PROMPT, *session.result.tokens]
        assert mine[-1].pos_start == 0 and mine[1].options == GenerationOptions(session.request.sampling)
        assert session.running and session.result.replays == 1
    # The restarted stage answers the lost step with an error: stale, nobody fails.
    wire.reply(error(lost, "session unknown", stage=1), now=1.6)
    wire.tick(1.7)
    beat(wire, 4.0, incarnations=(11, 22))
    wire.tick(4.0)  # past the grace an error waits for news of a restart
    assert a.running and b.running and a.result.replays == 1
    # The replay's last chunk yields the next token; decoding goes on where it stopped.
    wire.reply(token(wire.last(a, MessageKind.PREFILL_FINAL_EMBD), ids("llo")[0]), now=4.5)
    wire.tick(4.5)
    step = wire.last(a, MessageKind.DECODE_EMBD)
    assert step.pos_start == len(PROMPT) + 1 and int(step.tokens[0]) == ids("llo")[0]
    assert a.result.tokens == [*ids("he"), *ids("llo")]


def test_an_error_waits_briefly_for_news_of_a_restart_before_it_fails_the_session() -> None:
    sched, wire = scheduler(recovery_timeout_s=30.0)
    a, b = decoding(sched, wire)
    wire.reply(error(wire.last(a, MessageKind.DECODE_EMBD), "session unknown", stage=1), now=1.1)
    beat(wire, 1.3, incarnations=(11, 22))  # the restart's heartbeat came second
    assert a.running and a.result.replays == 1 and b.result.replays == 1
    # Without a restart, the error fails the session after the grace, with its own text.
    wire.reply(error(wire.last(b, MessageKind.PREFILL_FINAL_EMBD), "token id 9999 is outside the vocab"), now=2.0)
    wire.tick(2.0 + SUSPECT_GRACE_S - 0.1)
    assert b.running
    wire.tick(2.0 + SUSPECT_GRACE_S)
    assert b.state is GenerationState.FAILED and b.result.error == "token id 9999 is outside the vocab"
    assert a.running


def test_a_silent_stage_holds_the_queue_and_sessions_replay_once_it_is_heard_again() -> None:
    sched, wire = scheduler(recovery_timeout_s=30.0)
    a, b = decoding(sched, wire)
    late = sched.submit(request())  # no lane free: waits
    wire.reply(Reply.heartbeat(0, 0, 11), now=4.0)
    wire.tick(4.5)  # stage 1 silent 4 s, decode steps waiting 3.5 s: stage 1 is down
    assert sched.down == [LABELS[1]]
    assert a.running and b.running and late.state is GenerationState.WAITING
    wire.reply(ack(wire.last(a, MessageKind.CONFIGURE_GENERATION), stage=0), now=5.0)  # stale
    before = len(wire.sent)
    wire.tick(8.0)
    assert len(wire.sent) == before  # nothing leaves while a stage is down
    beat(wire, 9.0, incarnations=(11, 23))
    assert sched.down == []
    assert {m.kind for m in wire.sent[before:]} == {MessageKind.STOP, MessageKind.CONFIGURE_GENERATION,
                                                    MessageKind.PREFILL_FINAL_EMBD}
    assert a.result.replays == b.result.replays == 1


def test_a_stage_that_stays_down_fails_its_sessions_naming_it() -> None:
    sched, wire = scheduler(recovery_timeout_s=20.0)
    a, b = decoding(sched, wire)
    wire.reply(Reply.heartbeat(0, 0, 11), now=4.0)
    wire.tick(4.5)
    assert sched.down == [LABELS[1]]
    wire.tick(24.5)
    assert a.running
    wire.tick(24.6)
    for session in (a, b):
        assert session.state is GenerationState.FAILED and isinstance(session.error, StageTimeout)
        assert f"{LABELS[1]} failed and did not come back within 20 s" in str(session.error)
    assert sched.down == [] and sched.active == 0


def test_without_recovery_a_restart_changes_nothing_and_errors_fail_at_once() -> None:
    sched, wire = scheduler(recovery_timeout_s=0.0)
    a, _b = decoding(sched, wire)
    beat(wire, 1.5, incarnations=(11, 22))
    assert a.result.replays == 0
    wire.reply(error(wire.last(a, MessageKind.DECODE_EMBD), "session unknown", stage=1), now=1.6)
    assert a.state is GenerationState.FAILED


def test_a_restart_finishes_a_complete_text_whose_stop_may_be_lost_and_frees_its_lane() -> None:
    sched, wire = scheduler(recovery_timeout_s=30.0)
    beat(wire, 0.0)
    done = sched.submit(request(max_tokens=1))
    waiting = [sched.submit(request()) for _ in range(2)]
    wire.tick(0.0)
    first_token(wire, done, ids("he")[0], now=0.5)
    assert done.state is GenerationState.STOPPING  # its Stop is in flight
    beat(wire, 1.0, incarnations=(11, 22))  # stage 1 restarted: the Stop's Ack may never come
    assert done.state is GenerationState.FINISHED and done in wire.finished
    assert wire.kinds(done)[-1] is MessageKind.STOP  # sent again, best effort
    wire.tick(1.1)
    assert sched.active == 2 and waiting[1].running  # the freed lane went to the queue at once


def test_while_a_stage_is_down_the_driver_waits_instead_of_spinning() -> None:
    sched, wire = scheduler(prefill_chunk=1, recovery_timeout_s=30.0)
    beat(wire, 0.0)
    other = sched.submit(request())
    wire.tick(0.0)
    first_token(wire, other, ids("he")[0], now=0.5)  # decoding: a new prompt's chunks are paced
    long = sched.submit(request(prompt_ids=[2, *ids("he", "llo", "he", "llo")]))
    wire.tick(0.6)
    assert long.has_chunks
    wire.reply(Reply.heartbeat(0, 0, 11), now=4.0)
    wire.tick(4.5)
    assert sched.down == [LABELS[1]]
    assert sched.poll_timeout(10.0) > 0.0  # nothing can leave: no busy loop until the stage is back


def test_with_recovery_a_stage_0_that_takes_nothing_is_down_not_a_failure() -> None:
    sched, wire = scheduler(recovery_timeout_s=30.0)
    beat(wire, 0.0)
    wire.full = True  # stage 0 takes nothing within the send timeout
    first = sched.submit(request())
    second = sched.submit(request())
    wire.tick(0.5)
    assert first.running and second.running and wire.finished == []
    assert sched.down == [LABELS[0]]
    assert len(wire.attempts) == 1  # the sends behind the refused one are pointless now
    wire.full = False
    wire.tick(1.0)
    assert wire.sent == []  # held until stage 0 is heard from again
    beat(wire, 1.5)
    for session in (first, second):
        assert wire.kinds(session) == [MessageKind.STOP, MessageKind.CONFIGURE_GENERATION,
                                       MessageKind.PREFILL_FINAL_EMBD]


def test_every_message_carries_the_scheduler_s_driver_word_and_a_new_scheduler_draws_a_new_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.toml"
    path.write_text(topology_toml(model="m.gguf", ranges=[(0, 2), (2, 4)], topology_id="t", ports=[7000, 7001, 7002]))
    shape = PipelineShape.from_topology(TopologyConfig.from_toml(path))
    assert shape.driver_id == driver_id_for("tcp://127.0.0.1:7000")  # the return endpoint names the driver
    words = iter([5, 6])
    first = Scheduler(shape, TOKENIZER, incarnation=lambda: next(words))
    wire = FakeTransport(first)
    first.submit(request())
    wire.tick(0.0)
    assert wire.sent and {m.state.driver_incarnation for m in wire.sent} == {driver_word(shape.driver_id, 5)}
    second = Scheduler(shape, TOKENIZER, incarnation=lambda: next(words))
    wire = FakeTransport(second)
    second.submit(request())
    wire.tick(0.0)
    assert {m.state.driver_incarnation for m in wire.sent} == {driver_word(shape.driver_id, 6)}
    anonymous, wire = scheduler()  # a shape without a driver id: no word
    anonymous.submit(request())
    wire.tick(0.0)
    assert {m.state.driver_incarnation for m in wire.sent} == {0}


def test_a_driver_word_a_stage_saw_replaced_is_drawn_again_and_the_session_starts_over() -> None:
    shape = PipelineShape(LABELS, ("s0", "s1"), max_sessions=2, ctx_size=64, driver_id=9)
    words = iter([5, 6, 7])
    sched = Scheduler(shape, TOKENIZER, SchedulerSettings(reply_timeout_s=10.0, silence_s=3.0),
                      incarnation=lambda: next(words))
    wire = FakeTransport(sched)
    beat(wire, 0.0)
    a = sched.submit(request())
    wire.tick(0.0)
    refused = [m for m in wire.sent if m.session_id == a.session_id]
    for message in refused:  # the stage saw incarnation 5 of driver 9 replaced: an earlier process had it
        wire.reply(attrs.evolve(error(message, "driver incarnation ... was replaced"),
                                predicted_token=ErrorCause.DRIVER_REPLACED), now=0.1)
    before = len(wire.sent)
    wire.tick(0.1 + LANE_RETRY_S)
    again = wire.sent[before:]
    assert [m.kind for m in again][:2] == [MessageKind.STOP, MessageKind.CONFIGURE_GENERATION]
    assert {m.state.driver_incarnation for m in again} == {driver_word(9, 6)}  # drawn once, not per refusal
    assert a.running and sched.starved(0.2) == []  # not a lack of lanes: /health stays quiet


def lane_refusal(message: StageMessage, stage: int = 0) -> Reply:
    """A stage's answer when every lane is held: the cause code says so (docs/PROTOCOL.md §2.4)."""
    return Reply(kind=ReplyKind.ERROR, request_id=message.request_id, session_id=message.session_id,
                 stage_index=stage, error="lane limit reached: 2 live sessions", predicted_token=ErrorCause.LANE_LIMIT)


def test_a_session_refused_for_lack_of_a_lane_waits_and_starts_over_instead_of_failing() -> None:
    sched, wire = scheduler(prefill_chunk=2)  # recovery off: a lane refusal waits all the same
    beat(wire, 0.0)
    a = sched.submit(request())
    wire.tick(0.0)
    configure, chunk = wire.last(a, MessageKind.CONFIGURE_GENERATION), wire.last(a, MessageKind.PREFILL_EMBD)
    wire.reply(lane_refusal(configure), now=0.1)
    wire.reply(lane_refusal(chunk), now=0.1)  # the chunk sent with it: stale, not a second refusal
    before = len(wire.sent)
    wire.tick(0.1 + LANE_RETRY_S - 0.01)
    assert a.running and wire.sent[before:] == []  # waits; the prompt's other chunks wait with it
    assert sched.starved(0.5) == [LABELS[0]]  # /health names the stage
    wire.tick(0.1 + LANE_RETRY_S)
    again = [m.kind for m in wire.sent[before:]]
    assert again == [MessageKind.STOP, MessageKind.CONFIGURE_GENERATION, MessageKind.PREFILL_EMBD,
                     MessageKind.PREFILL_FINAL_EMBD]  # nobody decodes: the whole prompt leaves at once
    assert min(m.request_id for m in wire.sent[before:]) > chunk.request_id
    first_token(wire, a, ids("he")[0], now=1.5)
    assert a.running and a.result.tokens == ids("he") and a.result.replays == 0  # not a stage failure
    assert sched.starved(0.1 + STARVED_S + 0.01) == []


def test_a_session_refused_for_lack_of_a_lane_for_longer_than_the_reply_timeout_fails_with_the_stage_s_text() -> None:
    sched, wire = scheduler()
    beat(wire, 0.0)
    a = sched.submit(request())
    wire.tick(0.0)
    now = 0.0
    while a.running:
        assert now < 20.0, "the lane wait never ended"
        wire.reply(lane_refusal(wire.last(a, MessageKind.CONFIGURE_GENERATION), stage=1), now=now)
        beat(wire, now)
        now += LANE_RETRY_S
        wire.tick(now)
    assert a.state is GenerationState.FAILED and a.result.error == "lane limit reached: 2 live sessions"
    assert now > 10.0  # the scheduler's reply timeout


# --- issue 18: choices by fork, embeddings, logprobs ---------------------------------------------


def test_n_choices_prefill_the_prompt_once_and_fork_it_for_the_others() -> None:
    sched, wire = scheduler()
    first = sched.submit(attrs.evolve(request(max_tokens=3), n=2,
                                      sampling=attrs.evolve(request().sampling, temperature=1.0, seed=2**64 - 1)))
    (second,) = first.forks
    wire.tick(0.0)
    assert sched.active == 1 and sched._lanes.held == 2  # the waiting choice holds its lane already
    configure = wire.last(first, MessageKind.CONFIGURE_GENERATION)
    assert configure.options is not None and configure.options.keep_logits
    assert wire.kinds(second) == []
    first_token(wire, first, ids("he")[0], now=1.0)
    fork = wire.last(second)
    assert fork.kind is MessageKind.FORK_SESSION and fork.token_count == len(PROMPT)
    assert fork.options is not None and fork.options.fork_from == first.session_id
    assert fork.options.sampling.seed == 0  # seed + choice index, modulo 2**64
    assert not fork.options.keep_logits
    prefills = [m for m in wire.sent if m.kind.carries_tokens and m.kind is not MessageKind.DECODE_EMBD]
    assert [m.session_id for m in prefills] == [first.session_id]  # the prompt ran once
    wire.reply(token(fork, ids("llo")[0]), now=1.1)
    wire.tick(1.2)
    decodes = [m for m in wire.sent if m.kind is MessageKind.DECODE_EMBD]
    assert sorted((m.session_id, m.pos_start) for m in decodes) == [(first.session_id, len(PROMPT)),
                                                                       (second.session_id, len(PROMPT))]
    assert (first.choice, second.choice) == (0, 1) and second.result.tokens == [ids("llo")[0]]


def test_more_choices_than_lanes_are_refused_and_a_failed_first_choice_fails_the_others() -> None:
    sched, _ = scheduler()
    too_many = sched.submit(attrs.evolve(request(), n=3))
    assert too_many.done and "asks for 3 choices" in str(too_many.error)
    sched, wire = scheduler()
    first = sched.submit(attrs.evolve(request(), n=2))
    wire.tick(0.0)
    wire.reply(error(wire.last(first, MessageKind.PREFILL_FINAL_EMBD), "stage 0: boom"), now=0.5)
    (second,) = first.forks
    assert first.state is GenerationState.FAILED and second.state is GenerationState.FAILED
    assert second in wire.finished and sched._lanes.held <= 1


def test_cancelling_the_first_choice_cancels_the_waiting_ones() -> None:
    sched, wire = scheduler()
    first = sched.submit(attrs.evolve(request(), n=2))
    wire.tick(0.0)
    wire.perform(sched.cancel(first, 0.5), 0.5)
    assert first.forks[0].state is GenerationState.CANCELLED and first.forks[0] in wire.finished


def test_an_embedding_request_sends_its_options_and_ends_with_the_vector() -> None:
    import numpy as np

    from skippy_zmq.tokens.pooling import Pooling

    sched, wire = scheduler(prefill_chunk=2)
    session = sched.submit(attrs.evolve(request(max_tokens=0), embedding=Pooling.LAST))
    wire.tick(0.0)
    configure = wire.last(session, MessageKind.CONFIGURE_GENERATION)
    assert configure.options is not None and configure.options.embedding is Pooling.LAST
    wire.tick(0.1)
    last = wire.last(session, MessageKind.PREFILL_FINAL_EMBD)
    vector = np.array([0.6, 0.8], np.float32)
    wire.reply(Reply(kind=ReplyKind.EMBEDDING, request_id=last.request_id, session_id=session.session_id,
                     stage_index=1, embedding=vector), now=0.2)
    assert session.state is GenerationState.STOPPING and wire.kinds(session)[-1] is MessageKind.STOP
    assert session.result.embedding is vector and session.result.tokens == []


def test_logprobs_asked_for_are_kept_per_token_and_a_reply_without_them_fails_the_session() -> None:
    from skippy_zmq.tokens.logprobs import TokenLogprobs

    sched, wire = scheduler()
    session = sched.submit(attrs.evolve(request(), logprobs=1))
    wire.tick(0.0)
    configure = wire.last(session, MessageKind.CONFIGURE_GENERATION)
    assert configure.options is not None and configure.options.logprobs == 1
    final = wire.last(session, MessageKind.PREFILL_FINAL_EMBD)
    tok = ids("he")[0]
    wire.reply(attrs.evolve(token(final, tok), logprobs=TokenLogprobs(tok, -0.25, ((tok, -0.25),))), now=0.5)
    assert session.result.logprobs == [TokenLogprobs(tok, -0.25, ((tok, -0.25),))]
    wire.tick(0.6)
    wire.reply(token(wire.last(session, MessageKind.DECODE_EMBD), tok), now=0.7)
    assert session.state is GenerationState.FAILED and "without the logprobs" in str(session.error)
