"""The serving engine over a real pipeline of stage-worker threads (in-process, loopback TCP)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from skippy_zmq import defaults
from skippy_zmq.driver.engine import Delta, Done, Engine, Event, Failed, Ticket
from skippy_zmq.driver.generation import GenerationRequest
from skippy_zmq.driver.settings import SchedulerSettings
from skippy_zmq.errors import EngineUnavailable, QueueFull, RequestCancelled, RequestTimeout
from skippy_zmq.tokens.sampling import SamplingParams
from tests.conftest import TINY_LLAMA_LAYERS
from tests.pipeline_helpers import ThreadedPipeline, reference_greedy

WAIT_S = 30.0
GREEDY = SamplingParams(ignore_eos=True)
SERVING = SchedulerSettings(silence_s=5.0, gather_max_s=defaults.GATHER_MAX_S)
"""serve's gather window, stages silent after 5 s, the other settings at their defaults."""


class Stream:
    """The events of one ticket, collected from the engine thread."""

    def __init__(self) -> None:
        self.events: queue.Queue[Event] = queue.Queue()
        self.first_delta = threading.Event()

    def __call__(self, event: Event) -> None:
        if isinstance(event, Delta):
            self.first_delta.set()
        self.events.put(event)

    def end(self) -> tuple[list[Delta], Done | Failed]:
        """Every delta, then the final event (bounded wait)."""
        deltas: list[Delta] = []
        while True:
            event = self.events.get(timeout=WAIT_S)
            if isinstance(event, Delta):
                deltas.append(event)
            else:
                return deltas, event


@pytest.fixture
def pipeline(tmp_path: Path, tiny_llama_path: Path) -> Iterator[ThreadedPipeline]:
    with ThreadedPipeline(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 2, lane_count=2, ctx_size=2048) as pipe:
        yield pipe


def wait_for_free_lanes(pipeline: ThreadedPipeline) -> None:
    """Every stage frees the session once the Stop the engine sent reaches it (bounded wait)."""
    deadline = time.monotonic() + WAIT_S
    while pipeline.sessions() != [0, 0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipeline.sessions() == [0, 0]


def started(pipeline: ThreadedPipeline, settings: SchedulerSettings = SERVING) -> Engine:
    engine = Engine(pipeline.topology, pipeline.tokenizer, settings)
    engine.start()
    engine.wait_ready(WAIT_S)
    return engine


def request(prompt: str, max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_tokens=max_tokens, sampling=GREEDY)


def test_requests_beyond_the_lanes_all_finish_with_greedy_tokens(pipeline: ThreadedPipeline,
                                                                  tiny_llama_path: Path) -> None:
    engine = started(pipeline)
    try:
        prompts = ["hello world", "the quick brown fox", "once upon a time", "a b c d e f g", "one more"]
        streams = [Stream() for _ in prompts]
        for prompt, stream in zip(prompts, streams, strict=True):
            engine.submit(request(prompt), stream)
        for prompt, stream in zip(prompts, streams, strict=True):
            deltas, end = stream.end()
            assert isinstance(end, Done), end
            ids = pipeline.tokenizer.encode(prompt)
            assert end.result.tokens == reference_greedy(tiny_llama_path, ids, 8, set())
            assert [t for d in deltas for t in d.token_ids] == end.result.tokens
            assert "".join(d.text for d in deltas) == end.result.text
            assert end.result.finish_reason == "length"
        assert engine.queue_depth == 0
    finally:
        engine.close()
    wait_for_free_lanes(pipeline)


def test_cancel_frees_the_lanes_and_ends_the_ticket(pipeline: ThreadedPipeline) -> None:
    engine = started(pipeline)
    try:
        stream = Stream()
        ticket = engine.submit(request("hello world", max_tokens=100), stream)
        assert stream.first_delta.wait(WAIT_S)
        engine.cancel(ticket)
        _, end = stream.end()
        assert isinstance(end, Failed) and isinstance(end.error, RequestCancelled)
        done = Stream()
        engine.submit(request("after"), done)
        assert isinstance(done.end()[1], Done)
    finally:
        engine.close()
    wait_for_free_lanes(pipeline)


def test_a_cancel_while_drafted_steps_run_frees_the_lanes(pipeline: ThreadedPipeline) -> None:
    engine = started(pipeline)
    try:
        stream = Stream()
        drafted = attrs.evolve(request("a b c a b c a b c a b", max_tokens=200), draft_max=8)
        ticket = engine.submit(drafted, stream)
        assert stream.first_delta.wait(WAIT_S)
        engine.cancel(ticket)
        _, end = stream.end()
        assert isinstance(end, Failed) and isinstance(end.error, RequestCancelled)
        done = Stream()
        engine.submit(attrs.evolve(request("a b c a b c a b"), draft_max=8), done)
        assert isinstance(done.end()[1], Done)
    finally:
        engine.close()
    wait_for_free_lanes(pipeline)


def test_a_full_queue_refuses_with_queue_full(pipeline: ThreadedPipeline) -> None:
    engine = started(pipeline, attrs.evolve(SERVING, max_queue=1))
    try:
        tickets: list[Ticket] = []
        for prompt in "ab":  # one at a time: a request counts as queued until it holds a lane
            stream = Stream()
            tickets.append(engine.submit(request(prompt, max_tokens=200), stream))
            assert stream.first_delta.wait(WAIT_S)
        waiting = Stream()
        tickets.append(engine.submit(request("c"), waiting))
        with pytest.raises(QueueFull, match="max_queue 1"):
            engine.submit(request("d"), Stream())
        assert engine.queue_depth == 1
        for ticket in tickets[:2]:
            engine.cancel(ticket)
        assert isinstance(waiting.end()[1], Done)
    finally:
        engine.close()


def test_a_request_past_its_deadline_fails_with_request_timeout(pipeline: ThreadedPipeline) -> None:
    engine = started(pipeline, attrs.evolve(SERVING, request_timeout_s=0.2))
    try:
        stream = Stream()
        engine.submit(request("hello", max_tokens=100_000), stream)
        _, end = stream.end()
        assert isinstance(end, Failed) and isinstance(end.error, RequestTimeout)
        assert "request timeout of 0.2 s" in str(end.error)
    finally:
        engine.close()
    wait_for_free_lanes(pipeline)


def test_drain_refuses_new_requests_and_fails_what_is_left(pipeline: ThreadedPipeline) -> None:
    engine = started(pipeline)
    try:
        stream = Stream()
        engine.submit(request("hello", max_tokens=100_000), stream)
        assert stream.first_delta.wait(WAIT_S)
        engine.drain(0.2)
        assert engine.health().draining and not engine.health().ready
        with pytest.raises(EngineUnavailable):
            engine.submit(request("late"), Stream())
        _, end = stream.end()
        assert isinstance(end, Failed) and isinstance(end.error, EngineUnavailable)
    finally:
        engine.close()
    wait_for_free_lanes(pipeline)


def test_cut_drain_ends_a_long_drain_at_once(pipeline: ThreadedPipeline) -> None:
    engine = started(pipeline)
    try:
        stream = Stream()
        engine.submit(request("hello", max_tokens=100_000), stream)
        assert stream.first_delta.wait(WAIT_S)
        drain = threading.Thread(target=engine.drain, args=(600.0,))
        drain.start()
        deadline = time.monotonic() + WAIT_S
        while not engine.health().draining and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.health().draining
        engine.cut_drain()  # what a second SIGTERM does during the drain
        drain.join(WAIT_S)
        assert not drain.is_alive()
        _, end = stream.end()
        assert isinstance(end, Failed) and isinstance(end.error, EngineUnavailable)
        assert "a second signal cut the drain short" in str(end.error)
    finally:
        engine.close()
    wait_for_free_lanes(pipeline)


def test_health_names_silent_stages_before_start(tmp_path: Path, tiny_llama_path: Path) -> None:
    pipe = ThreadedPipeline(tmp_path, tiny_llama_path, TINY_LLAMA_LAYERS, 2)  # workers never started
    engine = Engine(pipe.topology, pipe.tokenizer, SchedulerSettings(gather_max_s=defaults.GATHER_MAX_S))
    assert not engine.health().ready
    with pytest.raises(EngineUnavailable):
        engine.submit(request("x"), Stream())
    engine.start()
    try:
        with pytest.raises(Exception, match=r"not ready after 0\.5 s: waiting for heartbeats from stage 0"):
            engine.wait_ready(0.5)
    finally:
        engine.close()


def test_a_request_the_wire_cannot_carry_fails_alone_and_serving_goes_on(pipeline: ThreadedPipeline) -> None:
    engine = started(pipeline)
    try:
        bad = Stream()
        unsendable = GenerationRequest(prompt="x", max_tokens=4, sampling=SamplingParams(top_k=3_000_000_000))
        engine.submit(unsendable, bad)
        _, end = bad.end()
        assert isinstance(end, Failed) and "cannot be encoded" in str(end.error)
        good = Stream()
        engine.submit(request("hello"), good)
        assert isinstance(good.end()[1], Done)
        assert engine.alive and engine.health().ready
    finally:
        engine.close()
    wait_for_free_lanes(pipeline)


def test_requests_a_free_lane_takes_at_once_are_not_queued(pipeline: ThreadedPipeline) -> None:
    engine = started(pipeline, attrs.evolve(SERVING, max_queue=0))
    try:
        streams = [Stream(), Stream()]
        for prompt, stream in zip("ab", streams, strict=True):
            engine.submit(request(prompt), stream)  # two free lanes: nothing waits
        assert all(isinstance(stream.end()[1], Done) for stream in streams)
    finally:
        engine.close()


def test_a_ticket_of_n_choices_tags_deltas_and_ends_once_every_choice_ended() -> None:
    """TicketBook in-process (no pipeline): the scheduler's actions of two choices become Deltas tagged
    with their choice and one Done holding both results."""
    import attrs

    from skippy_zmq.driver.engine import TicketBook
    from skippy_zmq.driver.lanes import Finished, Text
    from skippy_zmq.tokens.logprobs import TokenLogprobs
    from tests.driver.test_scheduler import PROMPT, scheduler, token

    sched, wire = scheduler()
    events: list[Event] = []
    book = TicketBook()
    ticket = Ticket("req-1", attrs.evolve(GenerationRequest(prompt="p", max_tokens=1, prompt_ids=PROMPT), n=2,
                                          logprobs=0), events.append, deadline=1e9)
    book.start(sched, ticket)
    assert ticket.session is not None and len(ticket.sessions) == 2 and len(book.live) == 2

    def perform(actions: list) -> None:  # type: ignore[type-arg]
        for action in actions:
            if isinstance(action, (Text, Finished)):
                book.on_action(action)
        wire.perform(actions, 0.0)

    perform(sched.tick(0.0))
    first, second = ticket.sessions
    lp = TokenLogprobs(7, -0.5)
    final = wire.last(first)
    assert final.kind.name == "PREFILL_FINAL_EMBD"
    perform(sched.on_reply(attrs.evolve(token(final, 7), logprobs=lp), 0.1))
    fork = wire.last(second)
    perform(sched.on_reply(attrs.evolve(token(fork, 7), logprobs=lp), 0.2))
    book.finish_complete()  # both texts complete (max_tokens 1): the request ends before the Stops' Acks
    deltas = [e for e in events if isinstance(e, Delta)]
    assert sorted((d.choice, d.token_ids, d.logprobs) for d in deltas) == [(0, (7,), (lp,)), (1, (7,), (lp,))]
    (done,) = [e for e in events if isinstance(e, Done)]
    assert [r.choice for r in done.results] == [0, 1] and done.result is done.results[0]


def test_n_choices_compute_the_prompt_once_and_a_seed_reproduces_them(pipeline: ThreadedPipeline) -> None:

    engine = started(pipeline)
    try:
        hot = SamplingParams(temperature=1.5, seed=11, ignore_eos=True)
        prompt_ids = tuple(pipeline.tokenizer.encode("the quick brown fox"))
        runs = []
        for _ in range(2):
            before = [worker.metrics.counts.get("tokens", 0) for worker in pipeline.workers]
            stream = Stream()
            engine.submit(GenerationRequest(prompt="", prompt_ids=prompt_ids, max_tokens=6, sampling=hot, n=2), stream)
            deltas, end = stream.end()
            assert isinstance(end, Done), end
            wait_for_free_lanes(pipeline)
            computed = [worker.metrics.counts.get("tokens", 0) - b for worker, b in zip(pipeline.workers, before,
                                                                                          strict=True)]
            # The prompt once, then each choice's decode steps (its first token came from the fork).
            assert computed == [len(prompt_ids) + 2 * 5] * 2
            assert {d.choice for d in deltas} == {0, 1}
            runs.append([tuple(r.tokens) for r in end.results])
        assert runs[0] == runs[1]  # a seed reproduces both choices
        assert runs[0][0] != runs[0][1]  # which draw differently (seed + choice index)

    finally:
        engine.close()


def test_logprobs_and_embeddings_come_back_through_the_pipeline(pipeline: ThreadedPipeline) -> None:
    import numpy as np

    from skippy_zmq.tokens.pooling import Pooling

    engine = started(pipeline)
    try:
        stream = Stream()
        engine.submit(GenerationRequest(prompt="hello world", max_tokens=4, sampling=GREEDY, logprobs=2), stream)
        deltas, end = stream.end()
        assert isinstance(end, Done) and len(end.result.logprobs) == len(end.result.tokens) == 4
        assert [lp.token for d in deltas for lp in d.logprobs] == end.result.tokens
        assert all(lp.top[0][0] == lp.token and len(lp.top) == 2 for lp in end.result.logprobs)  # greedy
        stream = Stream()
        engine.submit(GenerationRequest(prompt="hello world", max_tokens=0, embedding=Pooling.MEAN), stream)
        _, end = stream.end()
        assert isinstance(end, Done) and end.result.embedding is not None and end.result.tokens == []
        assert float(np.linalg.norm(end.result.embedding)) == pytest.approx(1.0, abs=1e-5)
        wait_for_free_lanes(pipeline)
    finally:
        engine.close()


def test_a_replys_next_decode_step_leaves_before_its_text_reaches_the_request(
        pipeline: ThreadedPipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    # Handing a text over wakes the HTTP thread; the next step must not wait behind it (engine._step).
    from skippy_zmq.driver import engine as engine_module
    from skippy_zmq.driver.lanes import Send
    from skippy_zmq.wire.messages import MessageKind

    decodes_sent = [0]  # written and read on the engine thread only
    perform = engine_module.PipelineTransport.perform

    def counting(self: engine_module.PipelineTransport, actions: list[Any], on_event: Any) -> None:
        perform(self, actions, on_event)
        decodes_sent[0] += sum(1 for a in actions if isinstance(a, Send) and a.message.kind is MessageKind.DECODE_EMBD)

    monkeypatch.setattr(engine_module.PipelineTransport, "perform", counting)
    seen: list[tuple[int, int]] = []  # (tokens delivered so far, decode steps sent by then)
    stream = Stream()

    def recording(event: Event) -> None:
        if isinstance(event, Delta):
            seen.append(((seen[-1][0] if seen else 0) + len(event.token_ids), decodes_sent[0]))
        stream(event)

    engine = started(pipeline)
    try:
        engine.submit(request("the quick brown fox", max_tokens=6), recording)
        _, end = stream.end()
        assert isinstance(end, Done), end
    finally:
        engine.close()
    assert seen and seen[-1][0] == 6
    # Token k came back from decode step k - 1; before its text was handed over, step k had left.
    assert [(tokens, sent) for tokens, sent in seen if tokens < 6 and sent < tokens] == []
    wait_for_free_lanes(pipeline)


def test_with_the_prompt_cache_a_repeated_prompt_computes_one_row_and_gives_the_same_greedy_tokens(
        pipeline: ThreadedPipeline, tiny_llama_path: Path) -> None:
    engine = started(pipeline, attrs.evolve(SERVING, cache_prompts=True))
    try:
        prompt = "the quick brown fox jumps"
        ids = pipeline.tokenizer.encode(prompt)
        expected = reference_greedy(tiny_llama_path, ids, 8, set())
        first = Stream()
        engine.submit(request(prompt), first)
        _, end = first.end()
        assert isinstance(end, Done) and end.result.tokens == expected and end.result.cached_tokens == 0
        assert pipeline.sessions() == [1, 1]  # kept on both stages, not stopped
        before = [worker.metrics.counts.get("tokens", 0) for worker in pipeline.workers]
        again = Stream()
        engine.submit(request(prompt), again)
        _, end = again.end()
        assert isinstance(end, Done) and end.result.cached_tokens == len(ids) - 1
        assert end.result.tokens == expected
        computed = [worker.metrics.counts.get("tokens", 0) - b for worker, b in zip(pipeline.workers, before,
                                                                                       strict=True)]
        assert computed == [1 + 7, 1 + 7]  # the prompt's last token, then 7 decode steps
        assert pipeline.sessions() == [1, 1]
    finally:
        engine.close()
    wait_for_free_lanes(pipeline)  # closing the engine stopped the cached session on every stage
