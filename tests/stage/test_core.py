"""The socket-free stage core, in-process and deterministic: a fake clock, no sockets, no sleeps."""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from skippy_zmq import defaults
from skippy_zmq.config import TopologyConfig
from skippy_zmq.errors import CorruptTensorError, LimitError, StageError, WireError
from skippy_zmq.launch.topology import topology_toml
from skippy_zmq.model.gguf_file import read_header
from skippy_zmq.model.tensor_check import check_stage_tensors
from skippy_zmq.runtime.stage import StageRuntime
from skippy_zmq.stage.core import (
    _HANDLERS,
    Answer,
    Forward,
    Inbound,
    StageCore,
    check_fits,
    rest_of_pass_s,
    split_batch,
    takes_more,
)
from skippy_zmq.telemetry import EventLog, parse_event
from skippy_zmq.tokens.constraint import Constraint
from skippy_zmq.tokens.grammar import GrammarBook
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.tokens.tokenizer import Tokenizer, eog_ids_of
from skippy_zmq.wire.codecs import ActivationCodec
from skippy_zmq.wire.frames import ActivationFrame
from skippy_zmq.wire.messages import (
    MessageKind,
    StageMessage,
    StateHeader,
    driver_word,
    encode_activation,
    encode_message,
)
from skippy_zmq.wire.options import GenerationOptions
from skippy_zmq.wire.replies import ErrorCause, Reply, ReplyKind
from skippy_zmq.wire.trace import MAX_TRACE_RECORDS, TraceRecord
from tests.conftest import TINY_LLAMA_LAYERS

PROMPT = [2, 300, 301]
TTL_S = 10.0


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@attrs.define
class Pipeline:
    """Two stage cores wired by hand: stage 0's forwards are fed to stage 1."""

    cores: list[StageCore]
    clock: FakeClock
    logs: list[io.StringIO]

    def send(self, *messages: StageMessage, stopping: bool = False) -> list[Reply]:
        """Run `messages` as one batch on stage 0, forwards as one batch on stage 1; the replies."""
        batch: list[Any] = [encode_message(m) for m in messages]
        replies: list[Reply] = []
        for core in self.cores:
            inbound: list[Inbound] = []
            for frames in batch:
                accepted = core.accept(frames)
                if isinstance(accepted, Answer):
                    replies.append(accepted.reply)
                else:
                    inbound.append(accepted)
            batch = []
            for outcome in core.run(inbound, lambda: stopping):
                if isinstance(outcome, Forward):
                    batch.append(encode_message(outcome.message))
                else:
                    replies.append(outcome.reply)
        return replies

    def ask(self, *messages: StageMessage) -> list[int]:
        """Predicted tokens of `messages`, in order of session id; fails on any error."""
        replies = self.send(*messages)
        assert all(r.kind is ReplyKind.PREDICTED_TOKEN for r in replies), [r.error for r in replies]
        return [r.predicted_token for r in sorted(replies, key=lambda r: r.session_id)]

    def events(self, stage: int) -> list[dict[str, Any]]:
        """The JSON log events stage `stage` wrote."""
        lines = self.logs[stage].getvalue().splitlines()
        return [e for e in (parse_event(line) for line in lines) if e is not None]


def message(kind: MessageKind, session: int, request: int, tokens: Sequence[int] = (), pos: int = 0,
            **state: int) -> StageMessage:
    """A driver-side message to stage 0."""
    header = attrs.evolve(StateHeader.for_kind(kind, prompt_token_count=len(tokens)), **state)
    return StageMessage(kind=kind, pos_start=pos, token_count=len(tokens) if kind.carries_tokens else 0,
                        state=header, request_id=request, session_id=session, tokens=list(tokens))


def prefill(session: int, request: int, tokens: Sequence[int] = PROMPT) -> StageMessage:
    return message(MessageKind.PREFILL_FINAL_EMBD, session, request, tokens)


def decode(session: int, request: int, token: int, pos: int, step: int = 0) -> StageMessage:
    return message(MessageKind.DECODE_EMBD, session, request, [token], pos=pos, decode_step=step)


@pytest.fixture(scope="module")
def runtimes(tiny_llama_path: Path) -> tuple[StageRuntime, StageRuntime]:
    return (StageRuntime.load(tiny_llama_path, 0, 2, ctx_size=64),
            StageRuntime.load(tiny_llama_path, 2, TINY_LLAMA_LAYERS, ctx_size=64))


def build(tmp_path: Path, model: Path, runtimes: tuple[StageRuntime, StageRuntime], *,
          lane_count: int = 4, eog_ids: Sequence[int] = (), prefill_ttl_s: float = TTL_S,
          grammars: GrammarBook | None = None) -> Pipeline:
    text = topology_toml(model=str(model), ranges=[(0, 2), (2, TINY_LLAMA_LAYERS)], topology_id="core",
                         ports=[5000, 5001, 5002], lane_count=lane_count, ctx_size=64, n_layer=TINY_LLAMA_LAYERS)
    path = tmp_path / "topology.toml"
    ttls = f"session_ttl_s = {TTL_S}\nprefill_ttl_s = {prefill_ttl_s}\n"
    path.write_text(text.replace("ctx_size = 64\n", f"ctx_size = 64\n{ttls}"))
    topology = TopologyConfig.from_toml(path)
    for runtime in runtimes:  # module-scoped runtimes: start every test with no sessions
        for session_id in runtime.session_ids():
            runtime.close_session(session_id)
    clock = FakeClock()
    logs = [io.StringIO(), io.StringIO()]
    cores = [StageCore(topology, stage, runtime, log=EventLog(stage.stage_id, log, clock=clock), eog_ids=eog_ids,
                       grammars=grammars, clock=clock)
             for stage, runtime, log in zip(topology.stages, runtimes, logs, strict=True)]
    return Pipeline(cores, clock, logs)


@pytest.fixture
def pipe(tmp_path: Path, tiny_llama_path: Path, runtimes: tuple[StageRuntime, StageRuntime]) -> Pipeline:
    return build(tmp_path, tiny_llama_path, runtimes)


def whole_model_greedy(model: Path, n_tokens: int) -> list[int]:
    runtime = StageRuntime.load(model, 0, TINY_LLAMA_LAYERS, ctx_size=64)
    runtime.open_session(1)
    hidden = runtime.forward(1, 0, np.asarray(PROMPT, np.int32))
    tokens = []
    for position in range(len(PROMPT), len(PROMPT) + n_tokens):
        tokens.append(int(np.argmax(runtime.logits(hidden[-1:])[0])))
        hidden = runtime.forward(1, position, np.asarray(tokens[-1:], np.int32))
    return tokens


def test_every_message_kind_has_exactly_one_handler() -> None:
    assert set(_HANDLERS) == set(MessageKind)


def test_prefill_and_decode_through_two_cores_match_the_whole_model(pipe: Pipeline, tiny_llama_path: Path) -> None:
    (token,) = pipe.ask(prefill(5, 1))
    tokens = [token]
    for step in range(5):
        (token,) = pipe.ask(decode(5, 2 + step, tokens[-1], pos=len(PROMPT) + step, step=step))
        tokens.append(token)
    assert tokens == whole_model_greedy(tiny_llama_path, 6)


def test_a_reply_carries_one_trace_record_per_stage(pipe: Pipeline) -> None:
    (reply,) = pipe.send(prefill(5, 1))
    assert (reply.request_id, reply.session_id, reply.answered) == (1, 5, MessageKind.PREFILL_FINAL_EMBD)
    assert [r.stage_index for r in reply.trace] == [0, 1]
    assert reply.trace[0].bytes_out == reply.trace[1].bytes_in > 0


def test_lane_limit_refuses_by_name_and_stop_frees_every_stage(
    tmp_path: Path, tiny_llama_path: Path, runtimes: tuple[StageRuntime, StageRuntime]
) -> None:
    pipe = build(tmp_path, tiny_llama_path, runtimes, lane_count=2)
    replies = {r.session_id: r for r in pipe.send(prefill(1, 1), prefill(2, 2), prefill(3, 3))}
    assert [replies[i].kind for i in (1, 2)] == [ReplyKind.PREDICTED_TOKEN] * 2
    assert replies[3].kind is ReplyKind.ERROR and replies[3].stage_index == 0
    assert ('stage 0 "stage-0" (layers 0..2): request 3 session 3 (PREFILL_FINAL_EMBD): lane limit reached: '
            "2 live sessions (lane_count 2); session 3 rejected") in replies[3].error
    assert replies[3].error_cause is ErrorCause.LANE_LIMIT  # the driver waits for a lane instead of failing
    assert {replies[i].error_cause for i in (1, 2)} == {ErrorCause.UNSPECIFIED}
    (ack,) = pipe.send(message(MessageKind.STOP, 1, 4))
    assert (ack.kind, ack.answered, ack.stage_index) == (ReplyKind.ACK, MessageKind.STOP, 1)
    assert [len(core.sessions) for core in pipe.cores] == [1, 1]
    assert [core.runtime.has_session(1) for core in pipe.cores] == [False, False]
    assert pipe.ask(prefill(3, 5))  # the freed lane admits a new session


def test_messages_for_unknown_sessions_hold_no_lane(pipe: Pipeline) -> None:
    (reply,) = pipe.send(decode(9, 1, 300, pos=3))
    assert reply.kind is ReplyKind.ERROR and "session 9 is not open on this stage" in reply.error
    chunk = message(MessageKind.PREFILL_EMBD, 9, 2, [300], pos=4)
    (reply,) = pipe.send(chunk)
    assert reply.kind is ReplyKind.ERROR and "session 9 is not open on this stage" in reply.error
    assert [len(core.sessions) for core in pipe.cores] == [0, 0]


def test_idle_sessions_expire_after_the_ttl(pipe: Pipeline) -> None:
    (first,) = pipe.ask(prefill(5, 1))
    pipe.clock.now += TTL_S - 0.5
    assert [core.expire() for core in pipe.cores] == [[], []]
    pipe.ask(decode(5, 2, first, pos=3))  # use renews the session
    pipe.clock.now += TTL_S + 0.5
    assert [core.expire() for core in pipe.cores] == [[5], [5]]
    assert [e["session"] for e in pipe.events(1) if e["event"] == "session_expired"] == [5]
    (reply,) = pipe.send(decode(5, 3, first, pos=4))
    assert reply.kind is ReplyKind.ERROR and "session 5 is not open on this stage" in reply.error
    assert f"expired after {TTL_S:g} s idle" in reply.error


def test_an_idle_stage_gives_back_the_pages_of_freed_caches_once(pipe: Pipeline) -> None:
    pipe.ask(prefill(5, 1))
    pipe.clock.now += TTL_S + 0.5
    assert [core.expire() for core in pipe.cores] == [[5], [5]]  # closed: their slots keep their pages
    assert not any(e["event"] == "caches_released" for e in pipe.events(0))
    pipe.clock.now += defaults.WARM_CACHE_IDLE_S
    pipe.cores[0].expire()
    pipe.cores[0].expire()
    released = [e for e in pipe.events(0) if e["event"] == "caches_released"]
    pool = pipe.cores[0].runtime._kv.pool  # type: ignore[attr-defined]
    assert pool is not None  # the ggml kernel's sessions sit side by side in one pool
    assert len(released) == 1 and released[0]["slots"] == pool.slots
    pipe.ask(prefill(6, 2))  # a batch: the next idle spell releases again
    pipe.clock.now += defaults.WARM_CACHE_IDLE_S + 1
    pipe.cores[0].expire()
    assert sum(e["event"] == "caches_released" for e in pipe.events(0)) == 2


def test_rollback_and_trim_reproduce_earlier_tokens(pipe: Pipeline) -> None:
    (first,) = pipe.ask(prefill(5, 1))
    (second,) = pipe.ask(decode(5, 2, first, pos=3))
    pipe.ask(decode(5, 3, second, pos=4, step=1))
    # A decode at an earlier position trims every stage (KV and history) back to it.
    assert pipe.ask(decode(5, 4, first, pos=3)) == [second]
    final = pipe.cores[1].sessions
    assert [core.runtime.session_length(5) for core in pipe.cores] == [4, 4]
    # TrimSession keeps the first two positions; re-feeding the third reproduces `first`.
    trim = attrs.evolve(message(MessageKind.TRIM_SESSION, 5, 5), token_count=2)
    (ack,) = pipe.send(trim)
    assert (ack.kind, ack.answered) == (ReplyKind.ACK, MessageKind.TRIM_SESSION)
    assert [core.runtime.session_length(5) for core in pipe.cores] == [2, 2]
    assert final.get(5, create=False, now=pipe.clock.now).history == PROMPT[:2]
    assert pipe.ask(decode(5, 6, PROMPT[2], pos=2)) == [first]


def test_a_decode_ahead_of_its_session_is_refused_by_name(pipe: Pipeline) -> None:
    pipe.ask(prefill(5, 1))
    (reply,) = pipe.send(decode(5, 2, 300, pos=9))
    assert reply.kind is ReplyKind.ERROR and reply.stage_index == 0
    assert "decode at pos_start 9 but session 5 holds only 3 positions" in reply.error


def test_prefill_chunks_must_be_contiguous_and_fit_the_context(pipe: Pipeline) -> None:
    first = message(MessageKind.PREFILL_EMBD, 5, 1, [2, 300])
    assert pipe.send(first) == []  # a non-final chunk is answered by nobody
    (reply,) = pipe.send(message(MessageKind.PREFILL_FINAL_EMBD, 5, 2, [301], pos=3))
    assert "session 5: pos_start 3 does not match the 2 positions held in the KV cache" in reply.error
    (reply,) = pipe.send(message(MessageKind.PREFILL_FINAL_EMBD, 5, 3, [301] * 63, pos=2))
    assert "session 5: 2 + 63 positions exceed the context size 64" in reply.error
    (reply,) = pipe.send(message(MessageKind.PREFILL_FINAL_EMBD, 5, 4, [301], pos=2))
    assert reply.kind is ReplyKind.PREDICTED_TOKEN


def test_a_bad_row_fails_alone_before_the_batch_runs(pipe: Pipeline) -> None:
    first = dict(zip((1, 2), pipe.ask(prefill(1, 1), prefill(2, 2)), strict=True))
    replies = {r.session_id: r for r in pipe.send(decode(1, 11, first[1], pos=3), decode(2, 12, first[2], pos=7))}
    assert replies[1].kind is ReplyKind.PREDICTED_TOKEN
    assert replies[2].kind is ReplyKind.ERROR and "holds only 3 positions" in replies[2].error
    assert "errors.batch_retried_alone" not in pipe.cores[0].metrics.counts


def test_a_batch_that_fails_is_rerun_row_by_row(pipe: Pipeline, tiny_llama_path: Path) -> None:
    bad_id = Tokenizer.from_gguf(tiny_llama_path).n_vocab + 5
    first = dict(zip((1, 2), pipe.ask(prefill(1, 1), prefill(2, 2)), strict=True))
    replies = {r.session_id: r for r in pipe.send(decode(1, 11, first[1], pos=3), decode(2, 12, bad_id, pos=3))}
    assert pipe.cores[0].metrics.counts["errors.batch_retried_alone"] == 1
    assert replies[1].kind is ReplyKind.PREDICTED_TOKEN
    assert replies[2].kind is ReplyKind.ERROR and str(bad_id) in replies[2].error
    assert replies[1].predicted_token == whole_model_greedy(tiny_llama_path, 2)[1]
    # Session 1 goes on from where the batch left it; session 2 was rolled back too.
    assert [core.runtime.session_length(2) for core in pipe.cores] == [3, 3]
    (token,) = pipe.ask(decode(1, 13, replies[1].predicted_token, pos=4, step=1))
    assert token == whole_model_greedy(tiny_llama_path, 3)[2]


class CountingForward:
    """Wraps a runtime's forward_many and records how many sessions each pass carried."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.original = runtime.forward_many
        self.calls: list[int] = []

    def __enter__(self) -> CountingForward:
        def counting(session_ids: Sequence[int], *args: Any) -> np.ndarray:
            self.calls.append(len(session_ids))
            return self.original(session_ids, *args)

        self.runtime.forward_many = counting
        return self

    def __exit__(self, *_exc: object) -> None:
        del self.runtime.forward_many


def test_decodes_of_distinct_sessions_run_as_one_batch(pipe: Pipeline, tiny_llama_path: Path) -> None:
    first = pipe.ask(prefill(1, 1), prefill(2, 2), prefill(3, 3))
    with CountingForward(pipe.cores[0].runtime) as counted:
        tokens = pipe.ask(*(decode(s, 10 + s, first[s - 1], pos=3) for s in (1, 2, 3)))
    assert counted.calls == [3]
    assert tokens == [whole_model_greedy(tiny_llama_path, 2)[1]] * 3


def test_prefills_and_decodes_of_distinct_sessions_share_one_pass(pipe: Pipeline, tiny_llama_path: Path) -> None:
    (first,) = pipe.ask(prefill(1, 1))
    with CountingForward(pipe.cores[0].runtime) as counted:
        replies = {r.session_id: r for r in pipe.send(decode(1, 2, first, pos=3), prefill(2, 3), prefill(3, 4, [2, 300]))}
    assert counted.calls == [3]  # one decode row and two prompts of 3 and 2 rows
    expected = whole_model_greedy(tiny_llama_path, 2)
    assert [replies[s].predicted_token for s in (1, 2)] == [expected[1], expected[0]]
    assert replies[3].kind is ReplyKind.PREDICTED_TOKEN
    assert [core.runtime.session_length(3) for core in pipe.cores] == [2, 2]


def configure(session: int, request: int, sampling: SamplingParams) -> StageMessage:
    return attrs.evolve(message(MessageKind.CONFIGURE_GENERATION, session, request),
                        options=GenerationOptions(sampling),
                        state=StateHeader.for_kind(MessageKind.CONFIGURE_GENERATION, options=True))


def test_prompts_each_behind_their_own_configure_share_one_pass(pipe: Pipeline, tiny_llama_path: Path) -> None:
    # The driver sends ConfigureGeneration ahead of every new session's prompt; it must not cut
    # the prompts that arrived together into one pass each.
    greedy = SamplingParams.greedy()
    batch = [m for s in (1, 2, 3) for m in (configure(s, 10 * s, greedy), prefill(s, 10 * s + 1))]
    with CountingForward(pipe.cores[0].runtime) as counted:
        replies = pipe.send(*batch)
    assert counted.calls == [3]
    tokens = {r.session_id: r.predicted_token for r in replies if r.kind is ReplyKind.PREDICTED_TOKEN}
    assert tokens == dict.fromkeys((1, 2, 3), whole_model_greedy(tiny_llama_path, 1)[0])
    assert [r.kind for r in replies].count(ReplyKind.ACK) == 3


def test_a_control_message_still_waits_for_its_own_session_s_compute(pipe: Pipeline) -> None:
    (first,) = pipe.ask(prefill(5, 1))
    seeded = SamplingParams(temperature=0.5, top_k=5, seed=7)
    # Session 5's new settings wait for its decode, which runs (sharing a pass with session 6's
    # prompt) under the old ones; then the settings reach session 5's sampler on the final stage.
    with CountingForward(pipe.cores[0].runtime) as counted:
        replies = pipe.send(prefill(6, 4), decode(5, 2, first, pos=3), configure(5, 3, seeded))
    assert counted.calls == [2]
    token = next(r.predicted_token for r in replies if r.session_id == 5 and r.kind is ReplyKind.PREDICTED_TOKEN)
    assert token == pipe.ask(prefill(7, 5, [*PROMPT, first]))[0]  # greedy: the settings came after
    assert [r.kind for r in replies].count(ReplyKind.PREDICTED_TOKEN) == 2
    assert pipe.cores[1].sessions.get(5, create=False, now=pipe.clock.now).params == seeded
    assert [core.runtime.session_length(5) for core in pipe.cores] == [4, 4]


def test_a_session_s_second_message_waits_for_its_first(pipe: Pipeline) -> None:
    chunk = message(MessageKind.PREFILL_EMBD, 5, 1, [2, 300])
    rest = message(MessageKind.PREFILL_FINAL_EMBD, 5, 2, [301], pos=2)
    with CountingForward(pipe.cores[0].runtime) as counted:
        (reply,) = pipe.send(chunk, rest)
    assert reply.kind is ReplyKind.PREDICTED_TOKEN
    assert [core.runtime.session_length(5) for core in pipe.cores] == [3, 3]
    assert counted.calls == []  # each ran alone, in order, through forward()


def test_shutdown_answers_the_batch_in_hand_instead_of_running_it(pipe: Pipeline) -> None:
    replies = pipe.send(prefill(1, 1), message(MessageKind.STOP, 2, 2), stopping=True)
    assert [(r.kind, r.stage_index) for r in replies] == [(ReplyKind.ERROR, 0)] * 2
    assert all("stage is shutting down; message not run" in r.error for r in replies)
    assert [len(core.sessions) for core in pipe.cores] == [0, 0]


def test_configure_generation_sets_the_final_stage_sampler(pipe: Pipeline) -> None:
    sampling = SamplingParams(temperature=0.5, top_k=5, seed=7)  # exact in the f32 wire field
    configure = attrs.evolve(message(MessageKind.CONFIGURE_GENERATION, 5, 1), options=GenerationOptions(sampling),
                             state=StateHeader.for_kind(MessageKind.CONFIGURE_GENERATION, options=True))
    (ack,) = pipe.send(configure)
    assert ack.kind is ReplyKind.ACK
    assert pipe.cores[1].sessions.get(5, create=False, now=pipe.clock.now).params == sampling
    assert pipe.ask(prefill(5, 2))


def test_rejected_messages_are_answered_with_their_ids(pipe: Pipeline) -> None:
    core = pipe.cores[0]
    garbage = core.accept([b"not a stage message"])
    assert isinstance(garbage, Answer)
    assert (garbage.reply.kind, garbage.reply.request_id, garbage.reply.session_id) == (ReplyKind.ERROR, 0, 0)
    frames = [bytes(memoryview(f)) for f in encode_message(message(MessageKind.STOP, 9, 6))]
    cut = core.accept([frames[0][:-3], *frames[1:]])
    assert isinstance(cut, Answer)
    assert (cut.reply.request_id, cut.reply.session_id, cut.reply.answered) == (6, 9, MessageKind.STOP)
    assert 'stage 0 "stage-0" (layers 0..2): rejected message (request 6 session 9)' in cut.reply.error
    wrong_source = attrs.evolve(prefill(5, 7), state=attrs.evolve(prefill(5, 7).state, source_stage_index=0))
    refused = core.accept(encode_message(wrong_source))
    assert isinstance(refused, Answer) and "accepts messages from -1 only" in refused.reply.error
    assert core.metrics.counts["errors"] == 3


def test_a_codec_the_policy_does_not_admit_is_refused(pipe: Pipeline) -> None:
    stage0 = pipe.cores[0].stage
    frame = ActivationFrame.from_hidden(np.ones((1, 64), np.float32), producer_stage_index=0,
                                        layer_start=stage0.layer_start, layer_end=stage0.layer_end)
    plain = prefill(77, 5, [10])
    bf16 = attrs.evolve(
        plain,
        state=attrs.evolve(plain.state, source_stage_index=0, activation_codec=int(ActivationCodec.BF16_RNE_V1)),
        activation=encode_activation(ActivationCodec.BF16_RNE_V1, frame),
    )
    refused = pipe.cores[1].accept(encode_message(bf16))
    assert isinstance(refused, Answer) and refused.reply.session_id == 77
    assert "stage activation codec mismatch: got bf16-rne-v1, policy fixed admits raw-f32-v1" in refused.reply.error


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_an_activation_holding_nan_or_infinity_is_refused_naming_where(pipe: Pipeline, value: float) -> None:
    stage0 = pipe.cores[0].stage
    hidden = np.ones((2, 64), np.float32)
    hidden[1, 7] = value
    frame = ActivationFrame.from_hidden(hidden, producer_stage_index=0, layer_start=stage0.layer_start,
                                        layer_end=stage0.layer_end)
    plain = prefill(78, 6, [10, 11])
    poisoned = attrs.evolve(
        plain, state=attrs.evolve(plain.state, source_stage_index=0, activation_codec=int(ActivationCodec.RAW_F32_V1)),
        activation=encode_activation(ActivationCodec.RAW_F32_V1, frame))
    replies = pipe_stage1(pipe, poisoned)
    (reply,) = replies
    assert reply.kind is ReplyKind.ERROR and reply.session_id == 78
    assert (f"activation from stage 0 holds 1 non-finite values (first {value} at row 1, column 7); expected "
            "finite hidden states: that stage's weights may be damaged (restart it with --check-tensors)") in reply.error
    assert pipe.cores[1].metrics.counts["errors.FrameError"] == 1
    assert "nonfinite_logits" not in pipe.cores[1].metrics.counts  # refused before any compute


def pipe_stage1(pipe: Pipeline, message: StageMessage) -> list[Reply]:
    """Replies of stage 1 alone to `message` (as if stage 0 had forwarded it)."""
    core = pipe.cores[1]
    accepted = core.accept(encode_message(message))
    if isinstance(accepted, Answer):
        return [accepted.reply]
    return [o.reply for o in core.run([accepted], lambda: False) if not isinstance(o, Forward)]


def test_the_topology_and_the_runtime_must_agree_on_the_final_stage(
    pipe: Pipeline, runtimes: tuple[StageRuntime, StageRuntime]
) -> None:
    topology, stage = pipe.cores[1].topology, pipe.cores[1].stage
    with pytest.raises(StageError, match="the final stage but its runtime lacks the output head"):
        StageCore(topology, stage, runtimes[0])


def test_a_session_s_second_compute_message_waits_for_the_next_batch() -> None:
    chunk_1, chunk_2 = message(MessageKind.PREFILL_EMBD, 5, 1, [2, 300]), message(MessageKind.PREFILL_EMBD, 5, 2, [301], pos=2)
    batch = [chunk_1, decode(6, 3, 300, pos=3), chunk_2, message(MessageKind.STOP, 7, 4), decode(8, 5, 300, pos=3),
             message(MessageKind.STOP, 5, 6)]
    now, later = split_batch([Inbound(m, 0, 0.0, 0) for m in batch])
    # Other sessions' messages behind session 5's second chunk still run now; session 5's
    # Stop stays behind its chunk.
    assert [i.message.request_id for i in now] == [1, 3, 4, 5]
    assert [i.message.request_id for i in later] == [2, 6]
    assert split_batch(later) == (later, [])



def test_a_wave_of_prompts_is_spread_over_passes_by_their_rows_and_decode_steps_run_now() -> None:
    configure = MessageKind.CONFIGURE_GENERATION
    batch = [Inbound(m, 0, 0.0, 0) for m in (
        message(configure, 1, 1), prefill(1, 2, [2] * 40), decode(9, 3, 300, pos=5),
        message(configure, 2, 4), prefill(2, 5, [2] * 20), message(configure, 3, 6), prefill(3, 7, [2] * 10),
        decode(8, 8, 300, pos=5), prefill(4, 9, [2] * 4), message(MessageKind.STOP, 3, 10))]
    now, later = split_batch(batch, prefill_rows=64)
    # 40 + 20 rows run; the 10-row prompt would pass 64 and waits with its session's Stop; the
    # 4-row one behind it still fits.
    assert [i.message.request_id for i in now] == [1, 2, 3, 4, 5, 6, 8, 9]
    assert [i.message.request_id for i in later] == [7, 10]
    (alone,) = split_batch([Inbound(prefill(5, 11, [2] * 300), 0, 0.0, 0)], prefill_rows=64)[0]
    assert alone.message.request_id == 11  # the first chunk always runs, however long


def test_a_wave_of_new_prompts_drains_into_one_batch_with_their_configurations() -> None:
    configure = MessageKind.CONFIGURE_GENERATION
    batch: list[Inbound] = []
    for session in range(4):  # each new prompt arrives as its ConfigureGeneration, then its chunk
        for m in (message(configure, session, 2 * session), prefill(session, 2 * session + 1)):
            assert takes_more(batch, lanes=4)
            batch.append(Inbound(m, 0, 0.0, 0))
    assert not takes_more(batch, lanes=4)  # four compute messages: the lanes are full
    controls = [Inbound(message(configure, 10 + i, 20 + i), 0, 0.0, 0) for i in range(16)]
    assert takes_more(controls[:15], lanes=4) and not takes_more(controls, lanes=4)  # 4 x lanes in all

def test_a_pass_s_messages_downstream_say_more_follow_but_the_last(pipe: Pipeline) -> None:
    stage = pipe.cores[0]

    def forwards(*messages: StageMessage) -> list[StageMessage]:
        inbound = [stage.accept(encode_message(m)) for m in messages]
        assert all(isinstance(i, Inbound) for i in inbound)
        return [o.message for o in stage.run(inbound) if isinstance(o, Forward)]  # type: ignore[arg-type]

    greedy = SamplingParams.greedy()
    wave = forwards(configure(1, 1, greedy), prefill(1, 2), configure(2, 3, greedy), prefill(2, 4),
                    prefill(3, 5))
    # The configurations go on at once, alone; the three prompts' pass is marked but for its last.
    assert [(m.kind, m.pass_continues) for m in wave] == [
        (MessageKind.CONFIGURE_GENERATION, False), (MessageKind.CONFIGURE_GENERATION, False),
        (MessageKind.PREFILL_FINAL_EMBD, True), (MessageKind.PREFILL_FINAL_EMBD, True),
        (MessageKind.PREFILL_FINAL_EMBD, False)]
    # A pass of one, even one that came marked from its sender, says nothing follows.
    (alone,) = forwards(prefill(4, 6).with_pass_continues(True))
    assert not alone.pass_continues


def test_the_final_stage_marks_a_pass_s_replies_but_the_last(pipe: Pipeline) -> None:
    replies = pipe.send(prefill(1, 1), prefill(2, 2), prefill(3, 3))
    assert [(r.kind, r.pass_continues) for r in replies] == [
        (ReplyKind.PREDICTED_TOKEN, True), (ReplyKind.PREDICTED_TOKEN, True), (ReplyKind.PREDICTED_TOKEN, False)]
    (alone,) = pipe.send(decode(1, 4, replies[0].predicted_token, pos=len(PROMPT)))
    assert not alone.pass_continues


def test_a_marked_message_is_waited_for_a_bounded_time_after_it_arrived() -> None:
    marked = Inbound(prefill(1, 1).with_pass_continues(True), 0, 100.0, 0)
    last = Inbound(prefill(2, 2), 0, 100.0, 0)
    assert rest_of_pass_s([], 100.0) == 0.0
    assert rest_of_pass_s([marked], 100.0) == pytest.approx(defaults.REST_OF_PASS_S)
    assert rest_of_pass_s([marked], 100.0 + defaults.REST_OF_PASS_S / 2) == pytest.approx(defaults.REST_OF_PASS_S / 2)
    assert rest_of_pass_s([marked], 101.0) == 0.0  # its sender died mid-pass: run what came
    assert rest_of_pass_s([marked, last], 100.0) == 0.0  # the pass is complete
    assert rest_of_pass_s([marked], 100.0, max_s=5.0) == pytest.approx(5.0)


# --- no lockout: a session that never decodes is freed after prefill_ttl_s ---------------------

PREFILL_TTL_S = 3.0


def _metric(core: StageCore, name: str, **labels: str) -> float | None:
    return core.metrics.registry.get_sample_value(name, {"stage": core.stage.stage_id, **labels})


def test_fresh_prefills_cannot_hold_the_lanes_past_the_prefill_ttl(
    tmp_path: Path, tiny_llama_path: Path, runtimes: tuple[StageRuntime, StageRuntime]
) -> None:
    pipe = build(tmp_path, tiny_llama_path, runtimes, prefill_ttl_s=PREFILL_TTL_S)
    first = pipe.cores[0]
    assert _metric(first, "skippy_stage_lane_count") == 4
    # The attack: four prompts with fresh session ids, never a decode step.
    assert len(pipe.ask(*(prefill(s, s) for s in (1, 2, 3, 4)))) == 4
    assert _metric(first, "skippy_stage_sessions") == 4
    (refused,) = pipe.send(prefill(5, 5))
    assert refused.kind is ReplyKind.ERROR and "lane limit reached: 4 live sessions" in refused.error
    assert first.metrics.counts["lane_exhausted"] == 1
    assert first.metrics.counts["errors.LaneLimitError"] == 1
    assert _metric(first, "skippy_stage_lane_exhausted_total") == 1
    pipe.clock.now += PREFILL_TTL_S - 0.5
    assert [core.expire() for core in pipe.cores] == [[], []]
    pipe.clock.now += 1.0
    assert [core.expire() for core in pipe.cores] == [[1, 2, 3, 4]] * 2
    assert _metric(first, "skippy_stage_sessions_expired_total", phase="prefill") == 4
    assert _metric(first, "skippy_stage_sessions") == 0
    expired = [e for e in pipe.events(0) if e["event"] == "session_expired"]
    assert {(e["phase"], e["ttl_s"]) for e in expired} == {("prefill", PREFILL_TTL_S)}
    # A legitimate session is admitted and runs.
    (token,) = pipe.ask(prefill(6, 6))
    assert pipe.ask(decode(6, 7, token, pos=len(PROMPT)))


def test_a_decoding_session_keeps_the_session_ttl(
    tmp_path: Path, tiny_llama_path: Path, runtimes: tuple[StageRuntime, StageRuntime]
) -> None:
    pipe = build(tmp_path, tiny_llama_path, runtimes, prefill_ttl_s=PREFILL_TTL_S)
    first = dict(zip((1, 2), pipe.ask(prefill(1, 1), prefill(2, 2)), strict=True))
    pipe.ask(decode(1, 3, first[1], pos=len(PROMPT)))  # session 1 reaches decode, session 2 never does
    pipe.clock.now += PREFILL_TTL_S + 0.5
    assert [core.expire() for core in pipe.cores] == [[2], [2]]
    (reply,) = pipe.send(decode(2, 4, first[2], pos=len(PROMPT)))
    assert f"{PREFILL_TTL_S:g} s before its first decode step" in reply.error
    pipe.clock.now += TTL_S - PREFILL_TTL_S - 1.0
    assert [core.expire() for core in pipe.cores] == [[], []]
    pipe.clock.now += 1.0
    assert [core.expire() for core in pipe.cores] == [[1], [1]]
    assert pipe.cores[1].metrics.counts["expired.decode"] == 1
    assert [e["ttl_s"] for e in pipe.events(1) if e["event"] == "session_expired"] == [PREFILL_TTL_S, TTL_S]


def test_a_configured_session_that_never_decodes_expires_at_the_prefill_ttl(
    tmp_path: Path, tiny_llama_path: Path, runtimes: tuple[StageRuntime, StageRuntime]
) -> None:
    pipe = build(tmp_path, tiny_llama_path, runtimes, prefill_ttl_s=PREFILL_TTL_S)
    (ack,) = pipe.send(message(MessageKind.CONFIGURE_GENERATION, 9, 1))
    assert ack.kind is ReplyKind.ACK and [len(core.sessions) for core in pipe.cores] == [1, 1]
    pipe.clock.now += PREFILL_TTL_S + 0.5
    assert [core.expire() for core in pipe.cores] == [[9], [9]]


# --- refused before compute ---------------------------------------------------------------------


class ComputeSpy:
    """Counts every call into a runtime's layers (forward, forward_many)."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.calls = 0

    def __enter__(self) -> ComputeSpy:
        for name in ("forward", "forward_many"):
            original = getattr(self.runtime, name)

            def spy(*args: Any, _original: Any = original) -> Any:
                self.calls += 1
                return _original(*args)

            setattr(self.runtime, name, spy)
        return self

    def __exit__(self, *_exc: object) -> None:
        del self.runtime.forward, self.runtime.forward_many


def _traced(msg: StageMessage, records: int) -> StageMessage:
    return attrs.evolve(msg, trace=[TraceRecord(stage_index=0, received_at_us=1, sent_at_us=2)] * records)


def test_a_prefill_refused_for_its_trace_length_runs_no_compute(pipe: Pipeline) -> None:
    first = pipe.cores[0]
    with ComputeSpy(first.runtime) as spied:
        (reply,) = pipe.send(_traced(prefill(5, 1), MAX_TRACE_RECORDS))
    assert spied.calls == 0
    assert reply.kind is ReplyKind.ERROR and reply.stage_index == 0
    assert f"trace has {MAX_TRACE_RECORDS} records; forwarding adds this stage's" in reply.error
    assert [len(core.sessions) for core in pipe.cores] == [0, 0]  # and no lane was taken
    # One record fewer fits: stage 0 forwards 64, the final stage's reply keeps the last 64.
    (reply,) = pipe.send(_traced(prefill(5, 2), MAX_TRACE_RECORDS - 1))
    assert reply.kind is ReplyKind.PREDICTED_TOKEN and len(reply.trace) == MAX_TRACE_RECORDS


def test_a_prompt_past_the_context_is_refused_before_any_compute(pipe: Pipeline) -> None:
    with ComputeSpy(pipe.cores[0].runtime) as spied:
        refused = pipe.cores[0].accept(encode_message(prefill(5, 1, [300] * 65)))
    assert spied.calls == 0 and isinstance(refused, Answer)
    assert "session 5: 0 + 65 positions exceed the context size 64" in refused.reply.error
    assert len(pipe.cores[0].sessions) == 0


def test_an_output_frame_over_the_size_limit_is_refused_before_compute() -> None:
    chunk = message(MessageKind.PREFILL_EMBD, 5, 1, [300] * 1000)
    with pytest.raises(LimitError, match="1000 tokens make a 800000000-byte activation frame"):
        check_fits(chunk, is_final=False, ctx_size=10**6, n_embd=200_000)
    check_fits(chunk, is_final=True, ctx_size=10**6, n_embd=200_000)  # the final stage sends no frame


def test_refusals_are_logged_once_per_cause_per_interval_with_a_count(pipe: Pipeline) -> None:
    core = pipe.cores[0]
    for _ in range(10):
        assert isinstance(core.accept([b"garbage"]), Answer)
    assert core.metrics.counts["errors"] == 10  # every refusal is counted
    pipe.clock.now += 5.0
    assert isinstance(core.accept([b"garbage"]), Answer)
    lines = [e for e in pipe.events(0) if e["event"] == "message_rejected"]
    assert [e.get("suppressed") for e in lines] == [None, 9]


def test_request_id_0_is_reserved_for_heartbeats() -> None:
    from skippy_zmq.config import TopologyConfig as _Topology
    from skippy_zmq.errors import WireError as _WireError
    from skippy_zmq.stage.core import check_incoming as _check
    from skippy_zmq.wire.messages import MessageKind as _Kind
    from skippy_zmq.wire.messages import StageMessage as _Message
    from skippy_zmq.wire.messages import StateHeader as _State

    topology = _Topology.from_toml_text(
        'topology_id = "t"\nmodel = "m.gguf"\n[driver]\nreturn_bind = "tcp://127.0.0.1:7000"\n'
        '[[stages]]\nid = "s0"\nindex = 0\nlayer_start = 0\nlayer_end = 1\npull_bind = "tcp://127.0.0.1:7001"\n'
    )
    stop = _Message(kind=_Kind.STOP, pos_start=0, token_count=0, state=_State.for_kind(_Kind.STOP),
                    request_id=0, session_id=5)
    with pytest.raises(_WireError, match="request_id 0 is reserved for heartbeats"):
        _check(topology, topology.stages[0], stop)


# --- a NaN logit (damaged weights loaded without --check-tensors) fails the request, counted ------

def test_a_non_finite_logit_fails_the_request_naming_the_stage_and_the_flag(tmp_path: Path,
                                                                            tiny_llama_path: Path) -> None:
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(tiny_llama_path.read_bytes())
    offset = read_header(damaged).tensor("output_norm.weight").data_offset + 4 * 5
    with open(damaged, "r+b") as handle:
        handle.seek(offset)
        handle.write(np.float32(np.nan).tobytes())
    runtimes = (StageRuntime.load(damaged, 0, 2, ctx_size=64, weight_cache=None),
                StageRuntime.load(damaged, 2, TINY_LLAMA_LAYERS, ctx_size=64, weight_cache=None))
    pipe = build(tmp_path, damaged, runtimes)
    with np.errstate(invalid="ignore"):  # the NaN spreads through the head: the point of the test
        (reply,) = pipe.send(prefill(5, 1))
    assert reply.kind is ReplyKind.ERROR and reply.stage_index == 1
    assert reply.error.startswith('stage 1 "stage-1" (layers 2..4): request 1 session 5 (PREFILL_FINAL_EMBD): '
                                  "sampler: logit of token 0 is nan; expected finite logits: the model's weights "
                                  "may be damaged; restart the stages with --check-tensors to scan them")
    final = pipe.cores[1]
    assert final.metrics.counts["nonfinite_logits"] == 1 and final.metrics.counts["errors.NonFiniteLogits"] == 1
    assert _metric(final, "skippy_stage_nonfinite_logits_total") == 1
    assert _metric(pipe.cores[0], "skippy_stage_nonfinite_logits_total") is None
    with pytest.raises(CorruptTensorError, match=rf"output_norm.weight \(F32\): element 5 is nan at byte offset {offset}"):
        check_stage_tensors(damaged, 2, TINY_LLAMA_LAYERS, TINY_LLAMA_LAYERS)


# --- driver restarts (docs/PROTOCOL.md §5, Driver restarts) ------------------------------------

OLD_DRIVER = driver_word(7, 100)
NEW_DRIVER = driver_word(7, 200)
OTHER_DRIVER = driver_word(8, 100)


def test_a_new_incarnation_of_a_driver_frees_the_old_one_s_sessions_on_every_stage(
    tmp_path: Path, tiny_llama_path: Path, runtimes: tuple[StageRuntime, StageRuntime]
) -> None:
    pipe = build(tmp_path, tiny_llama_path, runtimes, lane_count=2)
    pipe.ask(*(message(MessageKind.PREFILL_FINAL_EMBD, s, 1, PROMPT, driver_incarnation=OLD_DRIVER) for s in (1, 2)))
    assert [len(core.sessions) for core in pipe.cores] == [2, 2]  # every lane held by a driver killed -9
    (token,) = pipe.ask(message(MessageKind.PREFILL_FINAL_EMBD, 3, 1, PROMPT, driver_incarnation=NEW_DRIVER))
    assert token >= 0  # no lane limit: the old sessions went when the new incarnation arrived
    assert [sorted(core.runtime.session_ids()) for core in pipe.cores] == [[3], [3]]
    for stage, core in enumerate(pipe.cores):
        (event,) = [e for e in pipe.events(stage) if e["event"] == "driver_restarted"]
        assert (event["driver"], event["sessions_freed"]) == (7, 2)
        assert event["replaced"] == "0x00070064 (driver 7, incarnation 100)"
        assert core.metrics.counts["sessions_freed.driver_restart"] == 2


def test_a_replaced_incarnation_s_late_messages_are_refused_by_name(pipe: Pipeline) -> None:
    pipe.ask(message(MessageKind.PREFILL_FINAL_EMBD, 1, 1, PROMPT, driver_incarnation=OLD_DRIVER))
    pipe.ask(message(MessageKind.PREFILL_FINAL_EMBD, 2, 1, PROMPT, driver_incarnation=NEW_DRIVER))
    late = [message(MessageKind.CONFIGURE_GENERATION, 5, 9, driver_incarnation=OLD_DRIVER),
            message(MessageKind.PREFILL_FINAL_EMBD, 6, 10, PROMPT, driver_incarnation=OLD_DRIVER),
            message(MessageKind.DECODE_EMBD, 1, 11, [300], pos=3, driver_incarnation=OLD_DRIVER)]
    replies = pipe.send(*late)
    assert [(r.kind, r.stage_index) for r in replies] == [(ReplyKind.ERROR, 0)] * 3
    assert replies[0].error == (
        'stage 0 "stage-0" (layers 0..2): rejected message (request 9 session 5): driver incarnation '
        "0x00070064 (driver 7, incarnation 100) was replaced on this stage by 0x000700c8 (driver 7, "
        "incarnation 200): a message from a driver process that has since restarted is not run")
    assert [sorted(core.runtime.session_ids()) for core in pipe.cores] == [[2], [2]]  # none opened
    assert pipe.cores[0].metrics.counts["errors.DriverReplacedError"] == 3
    assert {r.error_cause for r in replies} == {ErrorCause.DRIVER_REPLACED}


def test_a_replaced_driver_s_message_admitted_before_its_successor_s_opens_no_session(pipe: Pipeline) -> None:
    pipe.ask(message(MessageKind.PREFILL_FINAL_EMBD, 1, 1, PROMPT, driver_incarnation=OLD_DRIVER))
    core = pipe.cores[0]
    early = core.accept(encode_message(message(MessageKind.CONFIGURE_GENERATION, 5, 2, driver_incarnation=OLD_DRIVER)))
    assert isinstance(early, Inbound)  # admitted: the old incarnation was still the current one
    assert isinstance(core.accept(encode_message(
        message(MessageKind.PREFILL_FINAL_EMBD, 6, 1, PROMPT, driver_incarnation=NEW_DRIVER))), Inbound)
    (outcome,) = core.run([early])
    assert isinstance(outcome, Answer) and "driver incarnation 0x00070064" in outcome.reply.error
    assert 5 not in core.sessions


def test_two_drivers_sharing_a_pipeline_keep_each_other_s_sessions(pipe: Pipeline) -> None:
    pipe.ask(message(MessageKind.PREFILL_FINAL_EMBD, 1, 1, PROMPT, driver_incarnation=OLD_DRIVER),
             message(MessageKind.PREFILL_FINAL_EMBD, 2, 1, PROMPT, driver_incarnation=OTHER_DRIVER),
             message(MessageKind.PREFILL_FINAL_EMBD, 3, 1, PROMPT))  # 0: a sender that gives no word
    pipe.ask(message(MessageKind.DECODE_EMBD, 1, 2, [300], pos=3, driver_incarnation=OLD_DRIVER),
             message(MessageKind.DECODE_EMBD, 2, 2, [300], pos=3, driver_incarnation=OTHER_DRIVER))
    assert [len(core.sessions) for core in pipe.cores] == [3, 3]
    pipe.ask(message(MessageKind.PREFILL_FINAL_EMBD, 4, 1, PROMPT, driver_incarnation=NEW_DRIVER))
    # Driver 7 restarted: only its own session went; driver 8's and the anonymous one stay.
    assert [sorted(core.runtime.session_ids()) for core in pipe.cores] == [[2, 3, 4], [2, 3, 4]]


def test_a_state_word_that_is_no_driver_word_is_refused() -> None:
    for word in (-1, 0x0000_1234, 0x0007_0000):
        with pytest.raises(WireError, match="is not a driver word"):
            message(MessageKind.STOP, 1, 1, driver_incarnation=word)


# --- issue 18: logprobs, forks, embeddings -------------------------------------------------------


def configure_with(session: int, request: int, options: GenerationOptions) -> StageMessage:
    return attrs.evolve(message(MessageKind.CONFIGURE_GENERATION, session, request), options=options,
                        state=StateHeader.for_kind(MessageKind.CONFIGURE_GENERATION, prompt_token_count=len(PROMPT),
                                                   options=True))


def fork_message(target: int, source: int, request: int, positions: int, options: GenerationOptions) -> StageMessage:
    options = attrs.evolve(options, fork_from=source)
    return StageMessage(kind=MessageKind.FORK_SESSION, pos_start=0, token_count=positions,
                        state=StateHeader.for_kind(MessageKind.FORK_SESSION, prompt_token_count=positions,
                                                   options=True),
                        request_id=request, session_id=target, options=options)


def test_logprobs_are_those_of_the_raw_logits_before_the_bias(pipe: Pipeline, tiny_llama_path: Path) -> None:
    from skippy_zmq.tokens.logprobs import token_logprobs

    greedy_first = whole_model_greedy(tiny_llama_path, 1)[0]
    banned = GenerationOptions(SamplingParams(logit_bias={greedy_first: -100.0}), logprobs=3)
    pipe.send(configure_with(5, 1, banned))
    (reply,) = pipe.send(prefill(5, 2))
    assert reply.kind is ReplyKind.PREDICTED_TOKEN and reply.logprobs is not None
    assert reply.predicted_token != greedy_first  # the bias moved the pick ...
    assert reply.logprobs.top[0][0] == greedy_first  # ... not the reported distribution
    whole = StageRuntime.load(tiny_llama_path, 0, TINY_LLAMA_LAYERS, ctx_size=64)
    whole.open_session(1)
    logits = whole.logits(whole.forward(1, 0, np.asarray(PROMPT, np.int32))[-1:])[0]
    expected = token_logprobs(logits, reply.predicted_token, 3)
    assert reply.logprobs.logprob == pytest.approx(expected.logprob, abs=1e-5)
    assert [i for i, _ in reply.logprobs.top] == [i for i, _ in expected.top]
    pipe.send(configure_with(6, 3, GenerationOptions()))
    (plain,) = pipe.send(prefill(6, 4))
    assert plain.logprobs is None  # not asked: no extras travel


def test_post_sampling_logprobs_are_the_samplers_candidates_renormalised(pipe: Pipeline) -> None:
    sampling = SamplingParams(temperature=1.0, top_k=3, seed=5)
    picks = {}
    for session, options in ((5, GenerationOptions(sampling, logprobs=5, post_sampling=True)),
                             (6, GenerationOptions(sampling)),
                             (7, GenerationOptions(SamplingParams(), logprobs=2, post_sampling=True))):
        pipe.send(configure_with(session, session * 10, options))
        (reply,) = pipe.send(prefill(session, session * 10 + 1))
        picks[session] = reply
    sampled, plain, greedy = picks[5], picks[6], picks[7]
    assert sampled.predicted_token == plain.predicted_token  # asking for them changes nothing of the pick
    assert sampled.logprobs is not None and 1 <= len(sampled.logprobs.top) <= 3  # top_k 3 kept at most 3
    assert sum(math.exp(value) for _, value in sampled.logprobs.top) == pytest.approx(1.0, abs=1e-5)
    assert dict(sampled.logprobs.top)[sampled.predicted_token] == sampled.logprobs.logprob
    assert greedy.logprobs is not None and greedy.logprobs.top == ((greedy.predicted_token, 0.0),)


@pytest.mark.parametrize("logprobs", [0, 1, 3])
def test_a_greedy_logprobs_session_picks_what_a_plain_one_picks_and_reports_only_what_it_asked(
        tmp_path: Path, tiny_llama_path: Path, runtimes: tuple[StageRuntime, StageRuntime], logprobs: int) -> None:
    # With ignore_eos the pick is decided by the three largest ids (two banned end-of-generation
    # ids and one more), which the final stage reads from its logprobs table instead of the row.
    greedy_first, greedy_second = whole_model_greedy(tiny_llama_path, 2)
    pipe = build(tmp_path, tiny_llama_path, runtimes, eog_ids=[greedy_first, greedy_second])
    ignore = SamplingParams(ignore_eos=True)
    tokens = {}
    for session, options in ((5, GenerationOptions(ignore, logprobs=logprobs)), (6, GenerationOptions(ignore))):
        pipe.send(configure_with(session, session * 10, options))
        (reply,) = pipe.send(prefill(session, session * 10 + 1))
        tokens[session] = reply.predicted_token
        if options.logprobs is None:
            assert reply.logprobs is None
        else:
            assert reply.logprobs is not None and len(reply.logprobs.top) == logprobs
            assert reply.logprobs.token == reply.predicted_token
    assert tokens[5] == tokens[6] not in (greedy_first, greedy_second)


def test_a_pass_sums_its_logprobs_rows_in_one_run_a_stretch_with_each_row_s_values(
        pipe: Pipeline, tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from skippy_zmq.tokens import exp_sum
    from skippy_zmq.tokens.logprobs import token_logprobs

    inner = exp_sum.best(1)
    runs: list[int] = []
    single_rows: list[int] = []

    class Counting:
        name = "counting"

        def __call__(self, row: np.ndarray) -> float:
            single_rows.append(row.size)
            return inner(row)

        @property
        def columns(self) -> np.ndarray:
            return inner.columns

        def rows(self, block: np.ndarray) -> list[exp_sum.RowSum]:
            runs.append(block.shape[0])
            return inner.rows(block)

    monkeypatch.setattr(exp_sum, "best", lambda threads=1: Counting())
    asked = {5: 2, 6: None, 7: 0, 8: 3}  # rows 0, 2 and 3 of the pass ask: two stretches
    for session, logprobs in asked.items():
        pipe.send(configure_with(session, session * 10, GenerationOptions(logprobs=logprobs)))
    replies = pipe.send(*(prefill(session, session * 10 + 1) for session in asked))
    assert runs == [1, 2] and single_rows == []  # no row summed alone
    whole = StageRuntime.load(tiny_llama_path, 0, TINY_LLAMA_LAYERS, ctx_size=64)
    whole.open_session(1)
    logits = whole.logits(whole.forward(1, 0, np.asarray(PROMPT, np.int32))[-1:])[0]
    for reply in replies:
        wanted = asked[reply.session_id]
        assert reply.kind is ReplyKind.PREDICTED_TOKEN, reply.error
        if wanted is None:
            assert reply.logprobs is None
            continue
        expected = token_logprobs(logits, reply.predicted_token, wanted)
        assert reply.logprobs is not None and len(reply.logprobs.top) == wanted
        assert reply.logprobs.logprob == pytest.approx(expected.logprob, abs=1e-5)
        assert [i for i, _ in reply.logprobs.top] == [i for i, _ in expected.top]


def test_a_fork_copies_the_prompt_once_and_both_sessions_decode_alike(pipe: Pipeline) -> None:
    keep = GenerationOptions(keep_logits=True)
    pipe.send(configure_with(5, 1, keep))
    (first,) = pipe.ask(prefill(5, 2))
    computed = [core.metrics.counts["tokens"] for core in pipe.cores]
    (forked,) = pipe.send(fork_message(6, 5, 3, len(PROMPT), GenerationOptions()))
    assert forked.kind is ReplyKind.PREDICTED_TOKEN and forked.predicted_token == first  # greedy, same logits
    assert [core.metrics.counts["tokens"] for core in pipe.cores] == computed  # nothing recomputed
    assert [len(core.sessions) for core in pipe.cores] == [2, 2]
    a, b = pipe.ask(decode(5, 4, first, pos=len(PROMPT)), decode(6, 5, first, pos=len(PROMPT)))
    assert a == b
    pipe.send(message(MessageKind.STOP, 5, 6))
    (after,) = pipe.ask(decode(6, 7, b, pos=len(PROMPT) + 1))  # the copy outlives its source
    assert isinstance(after, int)


def test_a_fork_with_its_own_seed_draws_its_own_token(pipe: Pipeline) -> None:
    hot = SamplingParams(temperature=50.0, seed=1)
    pipe.send(configure_with(5, 1, GenerationOptions(hot, keep_logits=True)))
    (first,) = pipe.ask(prefill(5, 2))
    tokens = {first}
    for offset in range(1, 6):
        (reply,) = pipe.send(fork_message(10 + offset, 5, 2 + offset, len(PROMPT),
                                          GenerationOptions(attrs.evolve(hot, seed=1 + offset))))
        tokens.add(reply.predicted_token)
        pipe.send(message(MessageKind.STOP, 10 + offset, 20 + offset))
    assert len(tokens) > 1  # temperature 50 over the tiny vocab: six draws almost surely differ somewhere


def test_forks_without_kept_logits_or_from_nowhere_are_refused_by_name(pipe: Pipeline) -> None:
    pipe.send(configure_with(5, 1, GenerationOptions()))
    pipe.ask(prefill(5, 2))
    (reply,) = pipe.send(fork_message(6, 5, 3, len(PROMPT), GenerationOptions()))
    assert reply.kind is ReplyKind.ERROR and "the final stage kept none" in reply.error
    assert [len(core.sessions) for core in pipe.cores] == [2, 2]  # the forks opened on both; the driver stops it
    (reply,) = pipe.send(fork_message(7, 99, 4, 2, GenerationOptions()))
    assert reply.kind is ReplyKind.ERROR and "session 99 is not open" in reply.error
    (reply,) = pipe.send(fork_message(8, 5, 5, len(PROMPT) + 5, GenerationOptions()))
    assert reply.kind is ReplyKind.ERROR and "which holds 3" in reply.error


@pytest.mark.parametrize("pooling", ["MEAN", "LAST"])
def test_an_embedding_session_pools_its_chunks_as_one_prompt_does(pipe: Pipeline, pooling: str) -> None:
    from skippy_zmq.tokens.pooling import Pooling

    options = GenerationOptions(embedding=Pooling[pooling])
    pipe.send(configure_with(5, 1, options))
    (whole,) = pipe.send(prefill(5, 2))
    pipe.send(configure_with(6, 3, options))
    assert pipe.send(message(MessageKind.PREFILL_EMBD, 6, 4, PROMPT[:2])) == []
    (split,) = pipe.send(message(MessageKind.PREFILL_FINAL_EMBD, 6, 5, PROMPT[2:], pos=2))
    assert whole.kind is ReplyKind.EMBEDDING and split.kind is ReplyKind.EMBEDDING
    assert whole.embedding is not None and split.embedding is not None
    assert whole.embedding.shape == (pipe.cores[1].runtime.hparams.n_embd,)
    assert float(np.linalg.norm(whole.embedding)) == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(split.embedding, whole.embedding, atol=1e-5)
    (refused,) = pipe.send(decode(5, 6, 1, pos=len(PROMPT)))
    assert refused.kind is ReplyKind.ERROR and "embedding session" in refused.error


def test_a_session_that_asks_for_progress_hears_of_each_prompt_chunk_but_the_last(pipe: Pipeline) -> None:
    pipe.send(configure_with(5, 1, GenerationOptions(progress=True)))
    (first,) = pipe.send(message(MessageKind.PREFILL_EMBD, 5, 2, PROMPT[:1]))
    (second,) = pipe.send(message(MessageKind.PREFILL_EMBD, 5, 3, PROMPT[1:2], pos=1))
    assert (first.kind, first.answered, first.predicted_token) == (ReplyKind.ACK, MessageKind.PREFILL_EMBD, 1)
    assert (second.kind, second.request_id, second.predicted_token) == (ReplyKind.ACK, 3, 2)
    assert [record.stage_index for record in first.trace] == [0, 1]  # it ran through every stage
    (token,) = pipe.send(message(MessageKind.PREFILL_FINAL_EMBD, 5, 4, PROMPT[2:], pos=2))
    assert token.kind is ReplyKind.PREDICTED_TOKEN
    pipe.send(configure_with(6, 5, GenerationOptions()))
    assert pipe.send(message(MessageKind.PREFILL_EMBD, 6, 6, PROMPT[:2])) == []  # not asked: nobody hears


def test_the_logprob_of_a_token_the_bias_picked_is_its_raw_one(pipe: Pipeline, tiny_llama_path: Path) -> None:
    from skippy_zmq.tokens.logprobs import token_logprobs

    forced = 7  # biased up so far that greedy takes it: the sampler changes its logit in place
    pipe.send(configure_with(5, 1, GenerationOptions(SamplingParams(logit_bias={forced: 100.0}), logprobs=0)))
    (reply,) = pipe.send(prefill(5, 2))
    assert reply.predicted_token == forced and reply.logprobs is not None and reply.logprobs.top == ()
    whole = StageRuntime.load(tiny_llama_path, 0, TINY_LLAMA_LAYERS, ctx_size=64)
    whole.open_session(1)
    logits = whole.logits(whole.forward(1, 0, np.asarray(PROMPT, np.int32))[-1:])[0]
    assert reply.logprobs.logprob == pytest.approx(token_logprobs(logits, forced, 0).logprob, abs=1e-5)
    assert reply.logprobs.logprob < -1.0  # the raw one: with the bias it would be about 0


def test_a_fork_past_the_lane_limit_is_refused_and_leaves_no_copy(pipe: Pipeline) -> None:
    pipe.send(configure_with(5, 1, GenerationOptions(keep_logits=True)))
    pipe.ask(prefill(5, 2))
    for session in (6, 7, 8):  # every lane of the first stage taken (lane_count 4)
        pipe.send(configure_with(session, 10 + session, GenerationOptions()))
    (reply,) = pipe.send(fork_message(9, 5, 20, len(PROMPT), GenerationOptions()))
    assert reply.kind is ReplyKind.ERROR and reply.error_cause is ErrorCause.LANE_LIMIT
    assert not pipe.cores[0].runtime.has_session(9) and 9 not in pipe.cores[0].sessions


def test_a_batch_waits_for_the_decode_steps_of_the_newest_decode_batch_only(pipe: Pipeline) -> None:
    """`decoding_sessions` is what the worker's batching window waits for: the sessions of the last
    batch that held decode steps, so one that stopped decoding without a Stop (kept by a prompt
    cache) is not waited for again and again."""
    stage = pipe.cores[0]
    pipe.ask(prefill(1, 1), prefill(2, 2))
    assert stage.decoding_sessions() == 0  # nothing decoded yet
    pipe.ask(decode(1, 3, 5, len(PROMPT), 1), decode(2, 4, 6, len(PROMPT), 1))
    assert stage.decoding_sessions() == 2
    pipe.ask(decode(1, 5, 7, len(PROMPT) + 1, 2))  # session 2 finished: its lane is kept, no step comes
    assert stage.decoding_sessions() == 1
    pipe.ask(prefill(3, 6))  # a prefill-only batch leaves the expectation as it was
    assert stage.decoding_sessions() == 1
    pipe.clock.now += 3.0  # and sessions idle past DECODING_RECENT_S are never waited for
    assert stage.decoding_sessions() == 0


# --- constrained sessions -----------------------------------------------------------------------


def constrained_run(pipe: Pipeline, session: int, options: GenerationOptions, n_tokens: int,
                    prompt: Sequence[int] = PROMPT, generated: Sequence[int] = ()) -> list[int]:
    """Configure, prefill `prompt` + `generated` (a replay when `generated` is given), then decode
    greedily until an end-of-generation id or `n_tokens`; the tokens picked after `generated`."""
    configure_message = configure_with(session, 1, options)
    configure_message = attrs.evolve(configure_message, state=attrs.evolve(configure_message.state,
                                                                           prompt_token_count=len(prompt)))
    (ack,) = pipe.send(configure_message)
    assert ack.kind is ReplyKind.ACK, ack.error
    ids = [*prompt, *generated]
    first = attrs.evolve(prefill(session, 2, ids), state=attrs.evolve(prefill(session, 2, ids).state,
                                                                        prompt_token_count=len(prompt)))
    tokens = pipe.ask(first)
    while len(tokens) < n_tokens and tokens[-1] not in pipe.cores[1].eog_ids:
        tokens += pipe.ask(decode(session, 3 + len(tokens), tokens[-1], len(ids) + len(tokens) - 1))
    return tokens


@pytest.fixture
def constrained(tmp_path: Path, tiny_llama_path: Path, runtimes: tuple[StageRuntime, StageRuntime]) -> Pipeline:
    pytest.importorskip("llguidance")
    eog = sorted(eog_ids_of(tiny_llama_path))
    return build(tmp_path, tiny_llama_path, runtimes, eog_ids=eog, grammars=GrammarBook(tiny_llama_path, eog))


def test_a_constrained_session_generates_only_what_its_constraint_allows(constrained: Pipeline,
                                                                          tiny_llama_path: Path) -> None:
    tokenizer = Tokenizer.from_gguf(tiny_llama_path)
    free = whole_model_greedy(tiny_llama_path, 4)
    options = GenerationOptions(constraint=Constraint.regex("[0-9]{3}"))
    tokens = constrained_run(constrained, 5, options, 8)
    assert tokens[-1] in constrained.cores[1].eog_ids
    text = tokenizer.decode(tokens[:-1])
    assert re.fullmatch("[0-9]{3}", text), (text, tokenizer.decode(free))


def test_a_replayed_constrained_session_picks_what_the_uninterrupted_one_picked(constrained: Pipeline) -> None:
    options = GenerationOptions(SamplingParams(temperature=0.9, seed=11), constraint=Constraint.regex("[a-z]{2,6}"))
    whole = constrained_run(constrained, 5, options, 8)
    assert len(whole) >= 3
    replayed = constrained_run(constrained, 6, options, 8, generated=whole[:2])
    assert replayed == whole[2:]


def test_logprobs_of_a_constrained_session_are_the_models_and_its_fork_is_constrained_too(
        constrained: Pipeline, tiny_llama_path: Path) -> None:
    options = GenerationOptions(logprobs=2, keep_logits=True, constraint=Constraint.regex("(7|8)[0-9]"))
    (reply,) = constrained.send(configure_with(5, 1, options))
    (reply,) = constrained.send(prefill(5, 2))
    assert reply.logprobs is not None and reply.predicted_token == reply.logprobs.token
    tokenizer = Tokenizer.from_gguf(tiny_llama_path)
    assert tokenizer.decode([reply.predicted_token]) in ("7", "8")
    free = whole_model_greedy(tiny_llama_path, 1)[0]
    assert reply.logprobs.top[0][0] == free  # the distribution reported is the model's, before the mask
    (forked,) = constrained.send(fork_message(6, 5, 3, len(PROMPT), attrs.evolve(options, keep_logits=False)))
    assert tokenizer.decode([forked.predicted_token]) in ("7", "8")


def test_a_verification_checks_each_draft_against_the_constraint(constrained: Pipeline,
                                                                  tiny_llama_path: Path) -> None:
    # The session's matcher sees each accepted draft before the next row is sampled: a draft the constraint
    # forbids is never accepted, and the run goes on from what the constraint allows.
    options = GenerationOptions(constraint=Constraint.regex("[0-9]{4}"))
    whole = constrained_run(constrained, 5, options, 8)
    assert len(whole) == 5  # four digits, then the end of generation
    configure_message = configure_with(6, 1, options)
    constrained.send(configure_message)
    (first,) = constrained.ask(prefill(6, 2))
    assert first == whole[0]
    tokenizer = Tokenizer.from_gguf(tiny_llama_path)
    letter = tokenizer.encode("x", add_special=False)[0]
    verify = message(MessageKind.VERIFY_EMBD, 6, 3, [first, whole[1], letter, whole[3]], pos=len(PROMPT))
    (reply,) = constrained.send(verify)
    assert reply.kind is ReplyKind.PREDICTED_TOKENS, reply.error
    assert reply.tokens.tolist() == whole[1:3]  # the digit is accepted, the letter is not: the next digit instead
    assert re.fullmatch("[0-9]+", tokenizer.decode(reply.tokens.tolist()))


def test_a_stage_without_a_vocabulary_for_constraints_refuses_the_session(pipe: Pipeline) -> None:
    (reply,) = pipe.send(configure_with(5, 1, GenerationOptions(constraint=Constraint.json_object())))
    assert reply.kind is ReplyKind.ERROR
    assert "started without its vocabulary for constraints" in reply.error
