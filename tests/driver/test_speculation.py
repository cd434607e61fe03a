"""Draft-free speculation on the driver, in-process: the n-gram drafts, their sizing, and a scheduler whose
verifications give exactly the text of decoding one token at a time (docs/PROTOCOL.md §6, Speculative decoding)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_zmq.driver.generation import Generation, GenerationRequest, GenerationState, take_run
from skippy_zmq.driver.scheduler import Scheduler
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.driver.speculation import (
    BATCH_DRAFT_ROWS,
    MAX_PAUSE_STEPS,
    NGRAM_SIZES,
    PRIOR_ROW_SHARE,
    DraftPolicy,
    NgramDrafts,
    PassCost,
    Speculation,
    allocate,
    batch_share,
    check_draft_max,
)
from skippy_zmq.errors import ConfigError, WireError
from skippy_zmq.tokens.logprobs import TokenLogprobs
from skippy_zmq.wire.messages import MAX_DRAFT_TOKENS, MessageKind, StageMessage
from skippy_zmq.wire.replies import Reply, ReplyKind
from tests.driver.test_generation import EOS, PIECE_BASE, PIECES, TOKENIZER
from tests.driver.test_scheduler import SHAPE, FakeTransport, ack

# --- the n-gram drafts ------------------------------------------------------------------------


def oracle(tokens: Sequence[int], limit: int) -> tuple[int, ...]:
    """What followed the latest earlier occurrence of the last n tokens, n longest first, by brute force, as if
    the text from there on went on repeating itself."""
    for n in NGRAM_SIZES:
        if len(tokens) <= n:
            continue
        tail = list(tokens[-n:])
        for start in range(len(tokens) - 1, n - 1, -1):
            if list(tokens[start - n : start]) == tail:
                looped = list(tokens)
                while len(looped) < start + limit:
                    looped.append(looped[len(looped) - (len(tokens) - start)])
                return tuple(looped[start : start + limit]) if limit > 0 else ()
    return ()


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=40), cut=st.integers(0, 40), limit=st.integers(0, 8))
def test_the_drafts_are_what_followed_the_latest_earlier_match_of_the_last_tokens(
        tokens: list[int], cut: int, limit: int) -> None:
    drafts = NgramDrafts()
    drafts.extend(tokens[:cut])  # tokens join in any number of steps
    drafts.extend(tokens[cut:])
    assert drafts.propose(limit) == oracle(tokens, limit)


def test_a_repeated_stretch_is_proposed_and_fresh_text_proposes_nothing() -> None:
    drafts = NgramDrafts()
    drafts.extend([10, 11, 12, 13, 14, 15, 99, 10, 11, 12])
    assert drafts.propose(3) == (13, 14, 15)
    drafts.extend([50, 51])
    assert drafts.propose(3) == ()


def test_a_loop_is_drafted_as_far_as_asked_not_only_to_the_present() -> None:
    # a model repeating one token, or a loop of three: the stretch since the last match goes on
    drafts = NgramDrafts()
    drafts.extend([7, 5, 5, 5, 5, 5])
    assert drafts.propose(6) == (5,) * 6
    drafts = NgramDrafts()
    drafts.extend([9, 1, 2, 3, 1, 2, 3, 1, 2])
    assert drafts.propose(7) == (3, 1, 2, 3, 1, 2, 3)
    assert drafts.propose(2) == (3, 1)


# --- sizing -----------------------------------------------------------------------------------


def test_a_policy_grows_on_full_acceptance_shrinks_to_what_was_accepted_and_pauses_after_misses() -> None:
    policy = DraftPolicy(8)
    assert policy.allowed() == 8
    policy.verified(sent=8, accepted=3)
    assert policy.allowed() == 4
    policy.verified(sent=4, accepted=4)
    assert policy.allowed() == 8
    policy.verified(sent=8, accepted=0)  # a miss: one plain step, then one draft
    assert [policy.allowed(), policy.allowed()] == [0, 1]
    policy.verified(sent=1, accepted=0)  # a second miss in a row: two plain steps
    assert [policy.allowed(), policy.allowed(), policy.allowed()] == [0, 0, 1]
    for _ in range(20):
        policy.verified(sent=1, accepted=0)
    assert policy.pause == MAX_PAUSE_STEPS
    policy.pause = 0
    policy.verified(sent=1, accepted=1)  # a hit ends the misses
    assert (policy.misses, policy.allowed()) == (0, 2)


def test_a_batch_shares_its_draft_rows_and_a_wide_one_drafts_nothing() -> None:
    assert batch_share(1) == MAX_DRAFT_TOKENS
    assert [batch_share(n) for n in (2, 3, 4, 5, 16)] == [BATCH_DRAFT_ROWS // 2 - 1, 1, 1, 0, 0]


def test_a_pass_cost_is_fitted_to_the_passes_measured_and_assumed_before_their_sizes_vary() -> None:
    cost = PassCost()
    assert cost.fit() == (1.0, PRIOR_ROW_SHARE)  # nothing measured: only the ratio matters
    for _ in range(5):
        cost.observe(4, 0.28)  # one size only: the slope is the prior's, the mean kept
    fixed, per_row = cost.fit()
    assert per_row == pytest.approx(PRIOR_ROW_SHARE * fixed) and fixed + 4 * per_row == pytest.approx(0.28)
    cost = PassCost()
    for rows in (1, 4, 9, 2, 12, 5):  # an 8B model over two cores: 63 ms a pass and 37 ms a row
        cost.observe(rows, 0.063 + 0.037 * rows)
    assert cost.fit() == pytest.approx((0.063, 0.037))
    cost.observe(0, 1.0)
    cost.observe(3, 0.0)  # no rows, or no time: not a pass
    assert cost.fit() == pytest.approx((0.063, 0.037))


def test_drafts_go_where_their_expected_tokens_pay_for_the_rows_they_add() -> None:
    assert allocate([(5, 0.9), (3, 0.5)], (0.1, 0.0)) == [5, 3]  # rows cost nothing: every draft
    assert allocate([(5, 0.9), (3, 0.5)], (0.0, 1.0)) == [0, 0]  # rows are all the cost: none
    # One session alone, a row costs a tenth of a pass: the j-th draft (0.8^j expected tokens) pays while it beats
    # 0.1 x tokens / (1 + 0.1 x rows): 0.8 > 0.09, 0.64 > 0.15, 0.51 > 0.19, 0.41 > 0.21, 0.33 > 0.22, 0.26 > 0.23,
    # and 0.21 < 0.23
    assert allocate([(16, 0.8)], (1.0, 0.1)) == [6]
    # Four sessions of an 8B model (63 ms a pass, 37 ms a row): a coin-flip draft does not pay, a likely one does.
    assert allocate([(4, 0.5)] * 4, (0.063, 0.037)) == [0, 0, 0, 0]
    assert allocate([(4, 0.5), (4, 0.5), (4, 0.95), (4, 0.5)], (0.063, 0.037)) == [0, 0, 4, 0]
    # The likelier session's drafts come first, each session's in order.
    taken = allocate([(6, 0.6), (6, 0.9)], (1.0, 0.15))
    assert taken[1] > taken[0] > 0


def test_a_session_s_acceptance_counts_its_accepted_drafts_and_first_rejections() -> None:
    speculation = Speculation(8)
    assert speculation.acceptance == 0.5  # nothing decided yet
    prompt = [5, 6, 7, 8, 5, 6, 7]
    assert speculation.offer(prompt, [], room=8) == 8  # (8, 5, 6, 7) followed 5 6 7 before: looped twice
    assert speculation.propose(prompt, [], room=8, share=2) == (8, 5)
    speculation.verified(1)  # the first accepted, the second rejected
    assert (speculation.accepted, speculation.trials, speculation.acceptance) == (1, 2, 0.5)
    speculation.propose(prompt, [8, 9], room=8, share=8)
    speculation.in_flight = (1, 2, 3)
    speculation.verified(3)  # all accepted: nothing rejected to count
    assert (speculation.accepted, speculation.trials) == (4, 5)


def test_a_paused_session_counts_its_steps_even_when_the_pass_gives_it_no_drafts() -> None:
    speculation = Speculation(8)
    prompt = [5, 6, 7, 8, 5, 6, 7]
    speculation.propose(prompt, [], room=8, share=8)
    speculation.verified(0)  # a miss: one plain step
    assert speculation.offer(prompt, [9], room=8) == 0
    assert speculation.propose(prompt, [9], room=8, share=0) == ()  # the pass allotted nothing: still a step
    assert speculation.policy.pause == 0


@pytest.mark.parametrize("value", [-1, MAX_DRAFT_TOKENS + 1, 2.0, True, "4"])
def test_a_draft_count_outside_0_to_the_wire_limit_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^speculative.n_max {value!r} must be an integer from 0 "
                                          rf"\(no speculation\) to {MAX_DRAFT_TOKENS}$"):
        check_draft_max(value, "speculative.n_max")
    with pytest.raises(ConfigError, match="draft_max"):
        GenerationRequest(prompt="p", draft_max=value)  # type: ignore[arg-type]


# --- a scheduler speaking to a scripted final stage ---------------------------------------------

PROMPT = (2, *range(PIECE_BASE, PIECE_BASE + len(PIECES)))


class ScriptedModel:
    """A final stage whose model continues `script` (the token at output position i is script[i]): decode steps
    answer it one a step, verifications by the accept rule (§5, Speculative decoding), as the stages do."""

    def __init__(self, script: Sequence[int], logprobs: bool) -> None:
        self.script = list(script)
        self.logprobs = logprobs
        self.verified = 0  # drafts the verifications carried
        self.accepted = 0

    def _entry(self, token: int) -> TokenLogprobs:
        return TokenLogprobs(token, -0.5, ((token, -0.5),))

    def answer(self, message: StageMessage, done: int) -> Reply:
        """The reply to a compute message of a session that generated `done` tokens before it."""
        ids = {"request_id": message.request_id, "session_id": message.session_id, "stage_index": 1}
        if message.kind is not MessageKind.VERIFY_EMBD:
            token = self.script[done]
            return Reply(kind=ReplyKind.PREDICTED_TOKEN, predicted_token=token,
                         logprobs=self._entry(token) if self.logprobs else None, **ids)
        drafts = message.tokens[1:].tolist()
        run = []
        for index in range(len(drafts) + 1):
            run.append(self.script[done + index])
            if index == len(drafts) or run[-1] != drafts[index] or run[-1] == EOS:
                break
        self.verified += len(drafts)
        self.accepted += len(run) - 1
        return Reply(kind=ReplyKind.PREDICTED_TOKENS, predicted_token=run[-1], tokens=run,
                     token_logprobs=[self._entry(t) for t in run] if self.logprobs else (), **ids)


def run(script: Sequence[int], *, draft_max: int | None, settings_draft_max: int = 0, stop: tuple[str, ...] = (),
        max_tokens: int = 40, logprobs: bool = False, sessions: int = 1) -> tuple[list[Generation], ScriptedModel]:
    """Sessions of PROMPT through a scheduler answered by `ScriptedModel(script)` until they finish."""
    sched = Scheduler(SHAPE, TOKENIZER, SchedulerSettings(reply_timeout_s=10.0, silence_s=3.0, prefill_chunk=64,
                                                           draft_max=settings_draft_max),
                      new_session_id=itertools.count(101).__next__)
    wire = FakeTransport(sched)
    model = ScriptedModel(script, logprobs)
    request = GenerationRequest(prompt="p", max_tokens=max_tokens, stop=stop, prompt_ids=PROMPT, draft_max=draft_max,
                                logprobs=0 if logprobs else None)
    generations = [sched.submit(request) for _ in range(sessions)]
    now, answered = 0.0, 0
    while not all(g.done for g in generations):
        now += 0.01
        wire.tick(now)
        fresh = wire.sent[answered:]
        answered = len(wire.sent)
        for message in fresh:
            session = next(g for g in generations if g.session_id == message.session_id)
            if message.kind.carries_tokens and message.kind is not MessageKind.PREFILL_EMBD:
                wire.reply(model.answer(message, len(session.result.tokens)), now)
            elif message.kind.expects_reply:
                wire.reply(ack(message), now)
        assert now < 100, "the sessions never finished"
    return generations, model


SCRIPT_TOKENS = st.sampled_from([*range(PIECE_BASE, PIECE_BASE + len(PIECES)), EOS, 4 + ord("x"), 4 + 0xC3, 4 + 0xA9])


@settings(max_examples=60, deadline=None)
@given(pattern=st.lists(SCRIPT_TOKENS, min_size=1, max_size=6), repeats=st.integers(1, 8),
       tail=st.lists(SCRIPT_TOKENS, max_size=10), draft_max=st.integers(1, 8), max_tokens=st.integers(1, 40),
       stop=st.sampled_from([(), ("ld!",), ("wor",), ("\u00e9",)]), logprobs=st.booleans())
def test_verified_drafts_give_exactly_the_tokens_text_and_logprobs_of_one_token_a_step(
        pattern: list[int], repeats: int, tail: list[int], draft_max: int, max_tokens: int, stop: tuple[str, ...],
        logprobs: bool) -> None:
    script = (pattern * repeats + tail + [EOS]) + [PIECE_BASE] * 50  # repetitive text, then whatever follows
    (plain,), _ = run(script, draft_max=0, stop=stop, max_tokens=max_tokens, logprobs=logprobs)
    (drafted,), _ = run(script, draft_max=draft_max, stop=stop, max_tokens=max_tokens, logprobs=logprobs)
    for result in (plain.result, drafted.result):
        assert result.error is None
    assert drafted.result.tokens == plain.result.tokens
    assert drafted.result.text == plain.result.text
    assert drafted.result.finish_reason == plain.result.finish_reason
    assert drafted.result.logprobs == plain.result.logprobs
    assert drafted.position == plain.position  # what the stages hold, for the prompt cache
    assert drafted.state is plain.state is GenerationState.FINISHED


def test_a_repetitive_text_takes_fewer_steps_with_drafts_and_the_pipeline_s_default_applies() -> None:
    script = [*range(PIECE_BASE, PIECE_BASE + 5)] * 8 + [EOS]
    (plain,), _ = run(script, draft_max=0)
    (drafted,), model = run(script, draft_max=None, settings_draft_max=8)  # the request names none: serve's
    assert drafted.result.tokens == plain.result.tokens == script[:40]
    assert drafted.step <= plain.step // 3
    assert model.accepted > 0.8 * model.verified


def test_two_sessions_each_draft_less_than_one_alone_and_give_its_tokens() -> None:
    script = [*range(PIECE_BASE, PIECE_BASE + 5)] * 8 + [EOS]
    (alone,), _ = run(script, draft_max=8)
    pair, model = run(script, draft_max=8, sessions=2)
    assert [g.result.tokens for g in pair] == [alone.result.tokens] * 2
    assert pair[0].step > alone.step  # 3 drafts each instead of 8
    assert model.verified > 0


def test_a_verification_answered_with_other_tokens_than_its_drafts_is_a_wire_error() -> None:
    a, b, c, d = range(PIECE_BASE, PIECE_BASE + 4)
    request = GenerationRequest(prompt="p", max_tokens=20, prompt_ids=(2, a, b, c, d, a, b), draft_max=4)
    session = Generation.create(0, 77, request, TOKENIZER, 64)
    session.start(64, 0.0)
    session.accept(c, 0.1)
    outgoing = session.next_decode(MAX_DRAFT_TOKENS)
    assert (outgoing.kind, outgoing.tokens, outgoing.pos_start) == (MessageKind.VERIFY_EMBD, (c, d, a, b, c), 7)
    with pytest.raises(WireError, match=rf"answered a verification of drafts \[{d}, {a}, {b}, {c}\] with tokens "
                                        rf"\[{a}, 5\]; expected the accepted drafts and one token more"):
        take_run(session, [a, 5], 0.2)
    with pytest.raises(WireError, match="expected the accepted drafts and one token more"):
        take_run(session, [d, a, b, c, 5, 6], 0.2)
    assert take_run(session, [d, a, 9], 0.2) == "ldhe\x05"  # two drafts and the token after them
    assert (session.result.tokens, session.position, session.next_token) == ([c, d, a, 9], 10, 9)
