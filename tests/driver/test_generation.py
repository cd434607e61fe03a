"""Tests of skippy_zmq.session: one generation's messages, finish rules and streamed text."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from skippy_zmq.driver.generation import Generation, GenerationRequest, GenerationState
from skippy_zmq.errors import RequestError, StageTimeout
from skippy_zmq.testing.tiny import vocab_tokenizer
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.tokens.tokenizer import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    Tokenizer,
)
from skippy_zmq.wire.messages import FLAG_FINAL_CHUNK, FLAG_OPTIONS, MessageKind
from skippy_zmq.wire.options import GenerationOptions

EOS = 1
PIECES = ["he", "llo", "\u2581wor", "ld", "!", "EN", "D"]
PIECE_BASE = 4 + 256  # after 4 specials and 256 byte tokens


def small_tokenizer() -> Tokenizer:
    """4 specials, the 256 byte tokens, then PIECES; no BOS is added, so "" has no tokens."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [TOKEN_TYPE_CONTROL] * 3 + [TOKEN_TYPE_UNKNOWN] + [TOKEN_TYPE_BYTE] * 256
    types += [TOKEN_TYPE_NORMAL] * len(PIECES)
    return vocab_tokenizer([t.encode() for t in tokens], [0.0] * len(tokens), types,
                     bos_id=2, eos_id=EOS, unk_id=3, pad_id=0, add_bos=False)


def ids(*pieces: str) -> list[int]:
    """Token ids of vocab pieces (a leading space stands for U+2581)."""
    return [PIECE_BASE + PIECES.index(piece.replace(" ", "\u2581")) for piece in pieces]


def byte_ids(text: str) -> list[int]:
    """One byte token per UTF-8 byte of `text`."""
    return [4 + b for b in text.encode()]


TOKENIZER = small_tokenizer()
PROMPT = (2, *ids("he", "llo"))


def make(max_tokens: int = 16, *, stop: Sequence[str] = (), ignore_eos: bool = False, ctx_size: int = 64,
         prompt_ids: Sequence[int] = PROMPT) -> Generation:
    request = GenerationRequest(prompt="p", max_tokens=max_tokens, stop=tuple(stop),
                                sampling=SamplingParams(ignore_eos=ignore_eos), prompt_ids=tuple(prompt_ids))
    return Generation.create(0, 77, request, TOKENIZER, ctx_size)


def feed(session: Generation, tokens: Sequence[int]) -> list[str]:
    """Start the session and answer each message with the next token, like the final stage,
    until the session finishes; the streamed pieces."""
    session.start(4, now=0.0)
    pieces = []
    for step, token in enumerate(tokens):
        if not session.running:
            break
        pieces.append(session.accept(token, now=1.0 + step))
        if session.running:
            session.next_decode()
    return pieces


def test_eos_finishes_and_is_reported_but_never_rendered() -> None:
    session = make()
    pieces = feed(session, [*ids("he", "llo"), EOS])
    assert session.state is GenerationState.STOPPING
    assert session.result.finish_reason == "eos"
    assert session.result.tokens == [*ids("he", "llo"), EOS]
    assert session.result.text == "hello" == "".join(pieces)
    assert session.next_token is None


def test_ignore_eos_goes_on_past_eos_until_max_tokens() -> None:
    session = make(max_tokens=4, ignore_eos=True)
    pieces = feed(session, [*ids("he"), EOS, *ids("llo", "!")])
    assert session.result.finish_reason == "length"
    assert session.result.tokens == [*ids("he"), EOS, *ids("llo", "!")]
    assert "".join(pieces) == session.result.text == "hello!"


def test_max_tokens_finishes_with_length_after_exactly_that_many() -> None:
    session = make(max_tokens=3)
    feed(session, ids("he", "llo", " wor"))
    assert session.result.finish_reason == "length"
    assert len(session.result.tokens) == 3
    assert session.result.text == "hello wor"


def test_a_full_context_finishes_with_length() -> None:
    # 3 prompt positions in a context of 5: the prefill's token and two decode steps fit.
    session = make(ctx_size=5)
    feed(session, ids("he", "llo", "!"))
    assert session.result.finish_reason == "length"
    assert session.position == 5
    assert session.result.tokens == ids("he", "llo", "!")


def test_a_stop_string_across_tokens_ends_the_text_and_is_never_streamed() -> None:
    session = make(stop=["lo w"])
    pieces = feed(session, ids("he", "llo", " wor", "ld"))
    assert session.result.finish_reason == "stop"
    assert session.result.text == "hel"
    # The last 3 characters (the stop string's length - 1) wait until the session ends.
    assert pieces == ["", "he", "l"]
    assert len(session.result.tokens) == 3


def test_text_held_for_a_stop_string_is_released_as_the_text_grows() -> None:
    session = make(max_tokens=4, stop=["lo!"])
    pieces = feed(session, ids("he", "llo", "ld", "!"))
    assert pieces == ["", "hel", "lo", "ld!"]
    assert session.result.finish_reason == "length"


def test_the_earliest_of_several_stop_strings_wins() -> None:
    session = make(stop=["wor", "o w"])
    pieces = feed(session, ids("he", "llo", " wor"))
    assert session.result.text == "hell"
    assert "".join(pieces) == "hell"


def test_multibyte_characters_stream_whole() -> None:
    session = make(max_tokens=5)
    pieces = feed(session, [*ids("he"), *byte_ids("é"), *byte_ids("€")[:2]])
    # Bytes of an unfinished character wait; at the end they become U+FFFD.
    assert pieces == ["he", "", "é", "", "\ufffd"]
    assert session.result.text == "heé\ufffd"


def test_a_stop_string_made_of_byte_tokens() -> None:
    session = make(stop=["é!"])
    pieces = feed(session, [*ids("he"), *byte_ids("é"), *ids("!", "ld")])
    assert session.result.finish_reason == "stop"
    assert session.result.text == "he" == "".join(pieces)


def test_an_incomplete_character_at_the_end_may_complete_a_stop_string() -> None:
    session = make(max_tokens=2, stop=["\ufffd"])
    feed(session, [*ids("he"), byte_ids("é")[0]])
    assert (session.result.finish_reason, session.result.text) == ("stop", "he")


def test_start_configures_then_prefills_in_chunks() -> None:
    session = make(prompt_ids=[2, *ids("he", "llo", "he", "llo", "!")])
    out = session.start(4, now=5.0)
    assert session.has_chunks  # later chunks wait for the scheduler (it interleaves them with decodes)
    out.append(session.next_chunk())
    assert not session.has_chunks
    assert [o.kind for o in out] == [MessageKind.CONFIGURE_GENERATION, MessageKind.PREFILL_EMBD,
                                     MessageKind.PREFILL_FINAL_EMBD]
    assert [(o.pos_start, o.seq_id, len(o.tokens)) for o in out[1:]] == [(0, 0, 4), (4, 1, 2)]
    messages = [o.message(request_id=10 + i) for i, o in enumerate(out)]
    assert messages[0].options == GenerationOptions(SamplingParams()) and messages[0].state.flags & FLAG_OPTIONS
    assert messages[2].state.flags & FLAG_FINAL_CHUNK and not messages[1].state.flags & FLAG_FINAL_CHUNK
    assert all(m.session_id == 77 and m.state.prompt_token_count == 6 for m in messages)
    assert [m.request_id for m in messages] == [10, 11, 12]
    assert session.position == 6 and session.result.started_s == 5.0


def test_post_sampling_probs_reach_the_options_only_with_logprobs() -> None:
    def options(**given: object) -> GenerationOptions:
        request = GenerationRequest(prompt="p", max_tokens=4, prompt_ids=tuple(PROMPT), **given)  # type: ignore[arg-type]
        return Generation.create(0, 77, request, TOKENIZER, 64).options()

    assert options(logprobs=3, post_sampling_probs=True) == GenerationOptions(logprobs=3, post_sampling=True)
    assert options(post_sampling_probs=True) == GenerationOptions()  # nothing to carry them: asked of no one
    assert not options(logprobs=3).post_sampling


def test_decode_steps_feed_the_last_token_at_the_next_position() -> None:
    session = make()
    session.start(4, now=0.0)
    session.accept(ids("he")[0], now=1.0)
    assert session.next_token == ids("he")[0] and session.ready_at == 1.0
    message = session.next_decode().message(request_id=5)
    assert (message.kind, message.pos_start, message.token_count) == (MessageKind.DECODE_EMBD, 3, 1)
    assert (message.state.decode_step, message.state.current_token) == (1, ids("he")[0])
    np.testing.assert_array_equal(message.tokens, ids("he"))
    assert session.next_token is None and session.position == 4


def test_requests_that_cannot_run_end_at_once() -> None:
    empty = Generation.create(3, 1, GenerationRequest(prompt=""), TOKENIZER, 64)
    assert empty.state is GenerationState.FAILED and isinstance(empty.error, RequestError)
    assert empty.result.error == "prompt 3 tokenizes to no tokens"
    long = make(ctx_size=3)
    assert long.state is GenerationState.FAILED and isinstance(long.error, RequestError)
    assert long.result.error == "prompt 0 has 3 tokens; the pipeline's ctx_size 3 leaves no room to generate"
    none = make(max_tokens=0)
    assert (none.state, none.result.finish_reason, none.error) == (GenerationState.FINISHED, "length", None)


def test_failing_releases_held_text_and_keeps_the_typed_error() -> None:
    session = make(stop=["llo!"])
    assert feed(session, ids("he", "llo")) == ["", "he"]  # "llo" might start the stop string
    error = StageTimeout("no reply")
    assert session.fail(error, now=9.0) == "llo"
    assert session.state is GenerationState.FAILED and session.error is error
    assert (session.result.error, session.result.finish_reason, session.result.finished_s) == ("no reply", "error", 9.0)


def test_stopped_and_cancelled_sessions() -> None:
    session = make(max_tokens=1)
    feed(session, ids("he"))
    session.stopped(now=50.0)
    assert session.state is GenerationState.FINISHED and session.result.finished_s == 1.0
    running = make()
    running.start(4, now=0.0)
    running.cancel(now=2.0)
    assert running.state is GenerationState.CANCELLED and running.done and running.result.finish_reason == ""


def test_a_paused_session_sends_nothing_until_it_starts_over_uncounted_as_a_replay() -> None:
    session = make()
    session.start(prefill_chunk=1, now=0.0)  # a prompt of several chunks: some are left to send
    assert session.has_chunks
    session.pause()  # a stage had no lane for it
    assert not session.has_chunks and session.next_token is None and session.running
    out = session.replay(prefill_chunk=64, count=False)
    assert [o.kind for o in out] == [MessageKind.STOP, MessageKind.CONFIGURE_GENERATION, MessageKind.PREFILL_FINAL_EMBD]
    assert session.result.replays == 0
