"""Tests of skippy_zmq.driver.stage_figures: each stage's heartbeat load and token split, in-process with a
scripted clock; and through the scheduler, which feeds the book from heartbeats and decode replies."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq import defaults
from skippy_zmq.driver.generation import GenerationRequest
from skippy_zmq.driver.stage_figures import FigureBook, StageFigures, TokenSplit
from skippy_zmq.telemetry import HopTiming
from skippy_zmq.wire.messages import MessageKind
from skippy_zmq.wire.replies import Reply, StageLoad
from skippy_zmq.wire.trace import TraceRecord
from tests.driver.test_generation import ids
from tests.driver.test_scheduler import first_token, request, scheduler, token


def hop(stage: int, queue: int = 0, decode: int = 0, compute: int = 0, encode: int = 0, link: int = 0) -> HopTiming:
    return HopTiming(stage, queue, decode, compute, encode, link, 0)


def test_a_fresh_book_knows_every_stage_and_nothing_of_them() -> None:
    assert FigureBook(3).snapshot(0.0) == (StageFigures(0), StageFigures(1), StageFigures(2))


def test_heartbeats_give_each_stage_its_latest_load_and_time() -> None:
    book = FigureBook(2, every_s=0.0)
    book.beat(0, StageLoad(100, 1), 1.0)
    book.beat(0, StageLoad(200, 3), 2.0)
    book.beat(1, None, 2.5)  # a stage that sends no load: heard, load unknown
    book.beat(7, StageLoad(1, 1), 2.5)  # no such stage: ignored
    assert book.snapshot(3.0) == (StageFigures(0, 2.0, StageLoad(200, 3)), StageFigures(1, 2.5, None))


def test_a_split_is_the_mean_per_token_over_the_window_and_forgets_older_seconds() -> None:
    book = FigureBook(2, window_s=10, every_s=0.0)
    book.token([hop(0, queue=10, compute=100, link=30), hop(1, compute=300, encode=4)], 100.2)
    book.token([hop(0, queue=30, compute=300, link=10), hop(1, compute=500, encode=8, decode=2)], 105.9)
    first, second = book.snapshot(106.0)
    assert first.split == TokenSplit(2, 20.0, 0.0, 200.0, 0.0, 20.0)
    assert second.split == TokenSplit(2, 0.0, 1.0, 400.0, 6.0, 0.0)
    assert second.split is not None and second.split.total_us == 407.0
    later = book.snapshot(110.5)  # second 100 left the window [101, 110]
    assert later[0].split == TokenSplit(1, 30.0, 0.0, 300.0, 0.0, 10.0)
    assert book.snapshot(116.0)[0].split is None  # idle for the whole window: nothing to split


def test_snapshots_are_made_at_most_every_interval_and_are_the_same_object_between() -> None:
    book = FigureBook(1, every_s=0.5)
    first = book.snapshot(1.0)
    book.beat(0, StageLoad(5, 0), 1.1)
    assert book.snapshot(1.4) is first
    assert book.snapshot(1.5) == (StageFigures(0, 1.1, StageLoad(5, 0)),)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 30), st.integers(0, 2), st.integers(0, 10**6)), max_size=40))
def test_a_split_never_counts_a_token_older_than_the_window(tokens: list[tuple[float, int, int]]) -> None:
    book = FigureBook(3, window_s=5, every_s=0.0)
    for now, stage, compute in sorted(tokens):
        book.token([hop(stage, compute=compute)], now)
    end = max((now for now, _, _ in tokens), default=0.0)
    for figures in book.snapshot(end):
        recent = [c for now, stage, c in tokens if stage == figures.index and int(now) > int(end) - 5]
        if not recent:
            assert figures.split is None
            continue
        assert figures.split is not None and figures.split.tokens == len(recent)
        assert figures.split.compute_us == pytest.approx(sum(recent) / len(recent))


def test_the_scheduler_feeds_heartbeat_loads_and_the_decode_steps_traces_only() -> None:
    sched, wire = scheduler()
    sched.figures.every_s = 0.0
    wire.reply(Reply.heartbeat(0, 0, 11, StageLoad(1 << 20, 1)), 0.5)
    wire.reply(Reply.heartbeat(1, 0, 21), 0.5)
    session = sched.submit(request())
    wire.tick(0.6)
    first_token(wire, session, ids("he")[0], now=1.0)  # the prompt's pass: not a token's time
    assert [figures.split for figures in sched.figures.snapshot(1.0)] == [None, None]
    wire.tick(1.1)
    step = wire.last(session, MessageKind.DECODE_EMBD)
    trace = (TraceRecord(0, 1_000, 1_500, queue_us=50, compute_us=400, encode_us=20),
             TraceRecord(1, 1_700, 2_600, compute_us=800))
    reply = token(step, ids("llo")[0])
    wire.reply(Reply(kind=reply.kind, request_id=reply.request_id, session_id=reply.session_id, stage_index=1,
                     predicted_token=reply.predicted_token, trace=trace), 1.2)
    stage0, stage1 = sched.figures.snapshot(1.2)
    assert (stage0.beat_at, stage0.load, stage1.load) == (0.5, StageLoad(1 << 20, 1), None)
    assert stage0.split == TokenSplit(1, 50.0, 0.0, 400.0, 20.0, 200.0)  # link: 1_700 - 1_500
    assert stage1.split is not None and (stage1.split.tokens, stage1.split.compute_us) == (1, 800.0)


def test_requests_draft_by_default_only_while_every_stage_says_it_computes_batch_invariantly() -> None:
    sched, _wire = scheduler()  # two stages; the settings name no draft count
    assert sched.settings.draft_max is None and not sched.figures.invariant
    assert sched.submit(request()).request.draft_max == 0  # nothing heard yet
    sched.on_reply(Reply.heartbeat(0, 1, 1, StageLoad(1, 0, invariant=True)), 1.0)
    assert sched.submit(request()).request.draft_max == 0  # stage 1 not heard yet
    sched.on_reply(Reply.heartbeat(1, 1, 1, StageLoad(1, 0, invariant=True)), 1.1)
    assert sched.figures.invariant and sched.submit(request()).request.draft_max == defaults.DRAFT_MAX
    named = GenerationRequest(prompt="p", max_tokens=8, prompt_ids=(2, 5), draft_max=3)
    assert sched.submit(named).request.draft_max == 3  # a request's own count wins
    sched.on_reply(Reply.heartbeat(1, 2, 1, StageLoad(1, 0)), 2.0)  # stage 1 now runs llama.cpp's kernels
    assert sched.submit(request()).request.draft_max == 0
    sched.on_reply(Reply.heartbeat(1, 3, 1), 3.0)  # a stage that sends no load: nothing known of its numerics
    assert not sched.figures.invariant
