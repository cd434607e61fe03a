"""Tests of skippy_zmq.driver.prefixes: the prompt cache's rules, and a scheduler that keeps
finished sessions on the stages and lets new prompts continue them (in-process, scripted clock)."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skippy_zmq.driver.generation import Generation, GenerationState
from skippy_zmq.driver.prefixes import SIMILARITY, PrefixCache, reusable_length
from skippy_zmq.driver.scheduler import PipelineShape, Scheduler
from skippy_zmq.errors import ConfigError
from skippy_zmq.wire.messages import MessageKind
from tests.driver.test_generation import ids
from tests.driver.test_scheduler import LABELS, PROMPT, FakeTransport, ack, beat, first_token, request, scheduler, token

SHAPE = PipelineShape(labels=LABELS, stage_ids=("s0", "s1"), max_sessions=2, ctx_size=64, session_ttl_s=100.0)
T0 = ids("he")[0]  # the first generated token of `decoded`


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_the_reusable_length_is_the_longest_shared_prefix_leaving_one_prompt_token(held: list[int],
                                                                                    prompt: list[int]) -> None:
    keep = reusable_length(held, prompt)
    assert 0 <= keep <= min(len(held), len(prompt) - 1)
    assert held[:keep] == prompt[:keep]
    assert keep == min(len(held), len(prompt) - 1) or held[keep] != prompt[keep]


def decoded(sched: Scheduler, wire: FakeTransport, now: float = 0.0, prompt: tuple[int, ...] = PROMPT,
            cache_prompt: bool = True) -> Generation:
    """A session that ran its prompt and one decode step, then finished at max_tokens 2."""
    session = sched.submit(attrs.evolve(request(max_tokens=2, prompt_ids=prompt), cache_prompt=cache_prompt))
    wire.tick(now)
    first_token(wire, session, T0, now + 0.1)
    wire.tick(now + 0.2)
    wire.reply(token(wire.last(session, MessageKind.DECODE_EMBD), ids("llo")[0]), now + 0.3)
    return session


def test_a_finished_session_stays_on_the_stages_and_a_prompt_continuing_it_computes_only_the_rest() -> None:
    sched, wire = scheduler(SHAPE, cache_prompts=True)
    a = decoded(sched, wire)
    # Finished at once, no Stop: its lane and its 4 positions (prompt + first token) stay.
    assert a.state is GenerationState.FINISHED and wire.finished == [a]
    assert MessageKind.STOP not in wire.kinds(a) and sched.active == 0
    follow_up = (*PROMPT, T0, *ids("llo"))
    b = sched.submit(request(prompt_ids=follow_up))
    wire.tick(1.0)
    assert b.session_id == a.session_id and b.result.session_id == a.session_id
    sent = [m for m in wire.sent if m.session_id == b.session_id][-3:]
    assert [m.kind for m in sent] == [MessageKind.TRIM_SESSION, MessageKind.CONFIGURE_GENERATION,
                                      MessageKind.PREFILL_FINAL_EMBD]
    assert sent[0].token_count == len(PROMPT) + 1
    assert sent[2].pos_start == len(PROMPT) + 1 and [int(t) for t in sent[2].tokens] == list(ids("llo"))
    assert b.result.cached_tokens == len(PROMPT) + 1 and sent[1].state.prompt_token_count == len(follow_up)
    # It decodes on from there like any session.
    wire.reply(token(sent[2], T0), 1.1)
    wire.tick(1.2)
    step = wire.last(b, MessageKind.DECODE_EMBD)
    assert step.pos_start == len(follow_up) and int(step.tokens[0]) == T0


def test_the_same_prompt_again_recomputes_only_its_last_token() -> None:
    sched, wire = scheduler(SHAPE, cache_prompts=True)
    a = decoded(sched, wire)
    b = sched.submit(request(prompt_ids=PROMPT))
    wire.tick(1.0)
    trim, _, chunk = [m for m in wire.sent if m.session_id == a.session_id][-3:]
    assert trim.kind is MessageKind.TRIM_SESSION and trim.token_count == len(PROMPT) - 1
    assert chunk.pos_start == len(PROMPT) - 1 and [int(t) for t in chunk.tokens] == [PROMPT[-1]]
    assert b.result.cached_tokens == len(PROMPT) - 1


def test_a_little_shared_takes_a_free_lane_and_a_full_pipeline_takes_over_the_best_retained_session() -> None:
    sched, wire = scheduler(SHAPE, cache_prompts=True)
    a = decoded(sched, wire)
    other = (PROMPT[0], 7, 8, 9, 10, 11)  # shares only its first token: under SIMILARITY of 6
    assert SIMILARITY * len(other) > 1
    b = sched.submit(request(prompt_ids=other))
    wire.tick(1.0)
    assert b.session_id != a.session_id and wire.kinds(b)[0] is MessageKind.CONFIGURE_GENERATION
    c = sched.submit(request(prompt_ids=other))  # b holds one lane, a the other: no lane is free
    wire.tick(1.1)
    assert c.session_id == a.session_id and c.result.cached_tokens == 1
    assert wire.last(c, MessageKind.TRIM_SESSION).token_count == 1


def test_nothing_shared_and_no_lane_free_trims_a_retained_session_to_nothing() -> None:
    sched, wire = scheduler(attrs.evolve(SHAPE, max_sessions=1), cache_prompts=True)
    a = decoded(sched, wire)
    b = sched.submit(request(prompt_ids=(5, 6)))
    wire.tick(1.0)
    assert b.session_id == a.session_id and wire.last(b, MessageKind.TRIM_SESSION).token_count == 0
    assert wire.last(b, MessageKind.PREFILL_FINAL_EMBD).pos_start == 0


def test_a_request_that_needs_new_lanes_stops_the_oldest_retained_sessions() -> None:
    sched, wire = scheduler(SHAPE, cache_prompts=True)
    a = decoded(sched, wire, now=0.0, prompt=(2, 5, 6))
    b = decoded(sched, wire, now=1.0, prompt=(2, 7, 8))
    assert len(sched.prompts) == 2
    choices = sched.submit(attrs.evolve(request(prompt_ids=PROMPT), n=2))  # n > 1 never takes one over
    wire.tick(2.0)
    assert wire.kinds(a)[-1] is MessageKind.STOP and wire.kinds(b)[-1] is MessageKind.STOP
    assert choices.session_id not in (a.session_id, b.session_id)
    assert wire.kinds(choices) == [MessageKind.CONFIGURE_GENERATION, MessageKind.PREFILL_FINAL_EMBD]


def test_a_session_that_never_decoded_or_opted_out_is_stopped_as_before() -> None:
    sched, wire = scheduler(SHAPE, cache_prompts=True)
    one = sched.submit(request(max_tokens=1))  # finished at its first token: the stages' prefill TTL is short
    wire.tick(0.0)
    first_token(wire, one, T0, 0.1)
    assert wire.kinds(one)[-1] is MessageKind.STOP and one.state is GenerationState.STOPPING
    opted_out = decoded(sched, wire, now=1.0, cache_prompt=False)
    assert wire.kinds(opted_out)[-1] is MessageKind.STOP
    assert len(sched.prompts) == 0
    for stopped in (one, opted_out):  # their lanes are free once the Stops are answered
        wire.reply(ack(wire.last(stopped, MessageKind.STOP)), 1.5)
    # And a request that opts out never takes one over either.
    kept = decoded(sched, wire, now=2.0)
    fresh = sched.submit(attrs.evolve(request(prompt_ids=PROMPT), cache_prompt=False))
    wire.tick(3.0)
    assert fresh.session_id != kept.session_id


def test_a_retained_session_is_stopped_after_half_the_stages_session_ttl() -> None:
    sched, wire = scheduler(SHAPE, cache_prompts=True)
    a = decoded(sched, wire)
    wire.tick(0.3 + 50.0)
    assert MessageKind.STOP not in wire.kinds(a)
    wire.tick(0.3 + 50.1)
    assert wire.kinds(a)[-1] is MessageKind.STOP and len(sched.prompts) == 0


def test_a_restarted_stage_drops_every_retained_session() -> None:
    sched, wire = scheduler(SHAPE, cache_prompts=True, recovery_timeout_s=30.0)
    beat(wire, 0.0)
    a = decoded(sched, wire)
    beat(wire, 1.0, incarnations=(11, 22))  # stage 1 is a new process: what it held is gone
    assert wire.kinds(a)[-1] is MessageKind.STOP
    b = sched.submit(request(prompt_ids=PROMPT))
    wire.tick(1.1)
    assert b.session_id != a.session_id and wire.kinds(b)[0] is MessageKind.CONFIGURE_GENERATION


def test_the_cache_needs_a_positive_retention() -> None:
    with pytest.raises(ConfigError, match="retain_s 0"):
        PrefixCache(0.0)
