"""Speculative verification on the stages, in-process (docs/PROTOCOL.md §5, Speculative decoding): in the
batch-invariant mode a verification's answer is exactly what decode steps one at a time would have picked."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skippy_zmq.compute import ggml
from skippy_zmq.config import TopologyConfig
from skippy_zmq.launch.topology import topology_toml
from skippy_zmq.runtime.kernels import Kernel
from skippy_zmq.runtime.stage import StageRuntime
from skippy_zmq.stage.core import StageCore
from skippy_zmq.testing.random_model import MIXES, ModelShape, write_random_model
from skippy_zmq.tokens.sampling import SamplingParams
from skippy_zmq.wire.messages import MessageKind, StageMessage, StateHeader
from skippy_zmq.wire.options import GenerationOptions
from skippy_zmq.wire.replies import Reply, ReplyKind
from tests.stage.test_core import FakeClock, Pipeline, message

SHAPE = ModelShape(name="gemma3-verify", arch="gemma3", n_layer=3, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
                   n_ff=512, rope_freq_base=1e6, rms_eps=1e-6, context_length=512, sliding_window=8)
PROMPT = [2, 17, 301, 95, 301, 17]
STEPS = 14
CTX = 64


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, StageRuntime, StageRuntime]]:
    """A small Gemma 3-shaped Q4_K_M file cut in two, in the batch-invariant mode."""
    if ggml.unavailable() is not None:
        pytest.skip(f"ggml kernel unavailable: {ggml.unavailable()}")
    path = write_random_model(tmp_path_factory.mktemp("verify") / "gemma3.gguf", SHAPE, seed=5, mix=MIXES["Q4_K_M"],
                              output_gain=0.5)

    def load(start: int, end: int) -> StageRuntime:
        return StageRuntime.load(path, start, end, ctx_size=CTX, kernel=Kernel("ggml", repack=True, invariant=True),
                                 weight_cache=None, cache_type_k="f16", cache_type_v="f16")

    yield path, load(0, 1), load(1, SHAPE.n_layer)


@pytest.fixture
def pipe(tmp_path: Path, runtimes: tuple[Path, StageRuntime, StageRuntime]) -> Pipeline:
    path, *pair = runtimes
    text = topology_toml(model=str(path), ranges=[(0, 1), (1, SHAPE.n_layer)], topology_id="verify",
                         ports=[5100, 5101, 5102], lane_count=4, ctx_size=CTX, n_layer=SHAPE.n_layer)
    (tmp_path / "topology.toml").write_text(text)
    topology = TopologyConfig.from_toml(tmp_path / "topology.toml")
    for runtime in pair:
        for session_id in runtime.session_ids():
            runtime.close_session(session_id)
    clock = FakeClock()
    cores = [StageCore(topology, stage, runtime, eog_ids=(1,), clock=clock)
             for stage, runtime in zip(topology.stages, pair, strict=True)]
    return Pipeline(cores, clock, [])


def start(pipe: Pipeline, session: int, options: GenerationOptions) -> Reply:
    """Configure `session` and prefill the prompt; the reply with its first token."""
    configure = attrs.evolve(message(MessageKind.CONFIGURE_GENERATION, session, 1), options=options,
                             state=StateHeader.for_kind(MessageKind.CONFIGURE_GENERATION,
                                                        prompt_token_count=len(PROMPT), options=True))
    (ack,) = pipe.send(configure)
    assert ack.kind is ReplyKind.ACK, ack.error
    prefill = message(MessageKind.PREFILL_FINAL_EMBD, session, 2, PROMPT)
    (reply,) = pipe.send(attrs.evolve(prefill, state=attrs.evolve(prefill.state, prompt_token_count=len(PROMPT))))
    assert reply.kind is ReplyKind.PREDICTED_TOKEN, reply.error
    return reply


def step(kind: MessageKind, session: int, request: int, tokens: Sequence[int], pos: int) -> StageMessage:
    base = message(kind, session, request, tokens, pos=pos)
    return attrs.evolve(base, state=attrs.evolve(base.state, prompt_token_count=len(PROMPT), current_token=tokens[0]))


def one_at_a_time(pipe: Pipeline, session: int, options: GenerationOptions) -> list[Reply]:
    """The first token and STEPS decode steps' replies, one token a step."""
    replies = [start(pipe, session, options)]
    for index in range(STEPS):
        (reply,) = pipe.send(step(MessageKind.DECODE_EMBD, session, 3 + index, [replies[-1].predicted_token],
                                  len(PROMPT) + index))
        assert reply.kind is ReplyKind.PREDICTED_TOKEN, reply.error
        replies.append(reply)
    return replies


OPTIONS = st.builds(
    GenerationOptions,
    sampling=st.builds(SamplingParams, temperature=st.sampled_from([0.0, 0.7, 1.5]), top_k=st.sampled_from([0, 8]),
                       repeat_penalty=st.sampled_from([1.0, 1.3]), seed=st.integers(0, 2**32)),
    logprobs=st.none() | st.integers(0, 3),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(options=OPTIONS, plans=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 6)), min_size=STEPS,
                                       max_size=STEPS))
def test_a_verification_answers_what_decode_steps_one_at_a_time_pick(
        pipe: Pipeline, options: GenerationOptions, plans: list[tuple[int, int]]) -> None:
    pipe.send(message(MessageKind.STOP, 10, 98), message(MessageKind.STOP, 11, 99))  # hypothesis reuses `pipe`
    n_vocab = pipe.cores[1].runtime.hparams.n_vocab
    # The reference: one token a step. Then another session verifies drafts of k tokens whose first `wrong`
    # are the reference's (the rest changed): the answer is those accepted and the reference's next token.
    reference = one_at_a_time(pipe, 10, options)
    tokens = [r.predicted_token for r in reference]
    got = [start(pipe, 11, options)]
    assert got[0].predicted_token == tokens[0]
    request = 100
    for drafts_wanted, wrong in plans:
        done = len(got)
        if done >= len(tokens) or tokens[done - 1] == 1:  # the reference ended (1: end of generation)
            break
        right = tokens[done : min(done + drafts_wanted, len(tokens) - 1)]  # the reference knows the token after
        drafts = [t if i < wrong else (t + 7) % n_vocab for i, t in enumerate(right)]
        if not drafts:
            break
        pos = len(PROMPT) + done - 1
        request += 1
        (reply,) = pipe.send(step(MessageKind.VERIFY_EMBD, 11, request, [tokens[done - 1], *drafts], pos))
        assert reply.kind is ReplyKind.PREDICTED_TOKENS, reply.error
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, right, strict=False)) if d != t), len(drafts))
        run = reply.tokens.tolist()
        expected = tokens[done : done + accepted + 1]
        ends = next((i for i, t in enumerate(expected) if t == 1), None)  # an end of generation ends the run
        assert run == (expected if ends is None else expected[: ends + 1])
        if options.logprobs is not None:
            assert list(reply.token_logprobs) == [r.logprobs for r in reference[done : done + len(run)]]
        # The final stage keeps what it accepted; stage 0 holds every draft until the session's next step.
        assert pipe.cores[1].runtime.session_length(11) == pos + len(run)
        assert pipe.cores[0].runtime.session_length(11) == pos + 1 + len(drafts)
        got += [reply] * len(run)


def test_a_verification_ahead_of_its_session_is_refused_naming_both_positions_and_the_session_goes_on(
        pipe: Pipeline) -> None:
    first = start(pipe, 12, GenerationOptions(SamplingParams.greedy())).predicted_token
    (reply,) = pipe.send(step(MessageKind.VERIFY_EMBD, 12, 3, [first, 5, 6], len(PROMPT) + 4))
    assert reply.kind is ReplyKind.ERROR and reply.stage_index == 0
    assert f"verification at pos_start {len(PROMPT) + 4} but session 12 holds only {len(PROMPT)} positions" \
        in reply.error
    (decoded,) = pipe.send(step(MessageKind.DECODE_EMBD, 12, 4, [first], len(PROMPT)))
    assert decoded.kind is ReplyKind.PREDICTED_TOKEN, decoded.error


def test_a_rejected_draft_s_positions_go_at_the_next_step_on_every_stage(pipe: Pipeline) -> None:
    greedy = GenerationOptions(SamplingParams.greedy())
    tokens = [r.predicted_token for r in one_at_a_time(pipe, 13, greedy)]
    start(pipe, 14, greedy)
    wrong = (tokens[1] + 1) % pipe.cores[1].runtime.hparams.n_vocab
    (reply,) = pipe.send(step(MessageKind.VERIFY_EMBD, 14, 3, [tokens[0], wrong, 9, 9], len(PROMPT)))
    assert reply.tokens.tolist() == [tokens[1]]
    assert [core.runtime.session_length(14) for core in pipe.cores] == [len(PROMPT) + 4, len(PROMPT) + 1]
    (after,) = pipe.send(step(MessageKind.DECODE_EMBD, 14, 4, [tokens[1]], len(PROMPT) + 1))
    assert after.predicted_token == tokens[2]
    assert [core.runtime.session_length(14) for core in pipe.cores] == [len(PROMPT) + 2] * 2
    assert pipe.cores[1].sessions.get(14, create=False, now=pipe.clock.now).history == [*PROMPT, *tokens[:2]]


def test_an_embedding_session_refuses_a_verification(pipe: Pipeline) -> None:
    from skippy_zmq.tokens.pooling import Pooling

    configure = attrs.evolve(message(MessageKind.CONFIGURE_GENERATION, 15, 1),
                             options=GenerationOptions(embedding=Pooling.MEAN),
                             state=StateHeader.for_kind(MessageKind.CONFIGURE_GENERATION, options=True))
    pipe.send(configure)
    (start_reply,) = pipe.send(message(MessageKind.PREFILL_FINAL_EMBD, 15, 2, PROMPT))
    assert start_reply.kind is ReplyKind.EMBEDDING
    (reply,) = pipe.send(step(MessageKind.VERIFY_EMBD, 15, 3, [5, 6], len(PROMPT)))
    assert reply.kind is ReplyKind.ERROR and "embedding session: it takes prefill chunks, not verifications" \
        in reply.error

